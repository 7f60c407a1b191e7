"""bench/gateway_bench.py's setup: the CPU executor it starts gets one intra-op thread. With torch's default (a
thread per core) on a small host the executor's steps wait on descheduled OpenMP workers whenever the gateway and
the clients also run, and the gateway's rounds stalled (43 s instead of 2.5 s); the direct rounds, with fewer
processes busy, did not."""

from __future__ import annotations

import os

import gateway_bench
import pytest


def test_the_cpu_executor_is_started_with_one_intra_op_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = gateway_bench.default_executor_threads("cpu")
    with gateway_bench.executor_environment(threads):
        assert os.environ["OMP_NUM_THREADS"] == "1"  # what start_server passes to the executor process
    assert "OMP_NUM_THREADS" not in os.environ  # the clients and the gateway keep the default


def test_a_gpu_executor_keeps_torchs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with gateway_bench.executor_environment(gateway_bench.default_executor_threads("cuda")):
        assert os.environ["OMP_NUM_THREADS"] == "7"
    assert os.environ["OMP_NUM_THREADS"] == "7"

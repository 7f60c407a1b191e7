"""The symmetric-memory all-reduces (parallel/all_reduce.py) on 2 and 4 GPUs (gpu marker): set up on every rank, and
their sums exact (integer inputs) for bf16 and fp32, from 8 elements through the one-shot and two-shot limits and
one past each, eagerly and replayed in a CUDA graph, through chains of dependent all-reduces that reuse one buffer
(`auto`: one-shot and two-shot by size, the all-reduce fused with the norm pushing its rows; `one-shot`:
one-shot alone; `push`: auto's; `signal`: auto's, the fused kernel signalling its peers), and
the fused all-reduce + norm over 1-32 rows against add_rms_norm of the exact sum. A negative control runs the same
cases on NCCL alone (SPECDEC_TP_ALL_REDUCE=nccl: the kind reported changes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

RUN = Path(__file__).with_name("all_reduce_run.py")
TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(world: int, choice: str) -> dict:
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "SPECDEC_TP_ALL_REDUCE": choice}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RUN), "--rank", str(r), "--world", str(world), "--init", init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [rank.communicate(timeout=TIMEOUT_S) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (_, stderr) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    return json.loads(outputs[0][0].strip().splitlines()[-1])


@pytest.mark.parametrize("choice", ["auto", "one-shot", "push", "signal"])
@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_all_reduces_sum_exactly(world: int, choice: str) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    report = run_ranks(world, choice)
    assert report["all_reduce"].startswith("one-shot"), report
    assert ("two-shot" in report["all_reduce"]) == (choice != "one-shot"), report
    assert ("fused" in report["all_reduce"]) == (choice != "one-shot"), report
    pushed = choice in ("push", "auto")
    assert ("pushed" in report["all_reduce"]) == pushed, report
    assert report["results"] and all(report["results"].values()), report["results"]


def test_nccl_choice_reports_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    report = run_ranks(2, "nccl")
    assert report["all_reduce"] == "nccl", report
    assert all(report["results"].values()), report["results"]

"""Replicas behind one address (issue 19): bench/replica_bench.py, small, with three tiny CPU executors.

One gRPC target lists the three (`ipv4:127.0.0.1:p1,...`, what a headless service's DNS name resolves to); the
client's channel (specdec_runtime.client: round_robin, retries on UNAVAILABLE before any response) must spread
the Generate calls over all three, counted by each replica's own GetLoads. Then one replica is stopped mid-run:
with SIGTERM (what Kubernetes and docker send) no request may be lost, those it refused being retried on the
others; with SIGKILL a request may only be lost if it had already streamed tokens (never retried: no repeats).
Every finished stream must carry the tokens the same prompt gets from one replica alone (greedy).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from compose_local import REPO_ROOT

pytest.importorskip("torch", reason="the executor needs torch")

TIMEOUT_S = 600  # only against hanging: three executors start and load on a shared 2-core machine
REQUESTS, CONCURRENCY = 12, 4


def run_bench(tmp_path, signal_name: str) -> dict:
    command = [
        sys.executable, str(REPO_ROOT / "bench" / "replica_bench.py"), "--requests", str(REQUESTS),
        "--concurrency", str(CONCURRENCY), "--max-tokens", "8", "--kill-signal", signal_name,
        "--out", str(tmp_path / "results"), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO_ROOT, check=False)
    files = list((tmp_path / "results").glob("replicas_*_cpu_*.json"))
    assert files, f"no result file (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(files[0].read_text())


def check_spread(report: dict) -> None:
    spread = report["spread"]
    assert spread["finished"] == REQUESTS, spread["lost"]
    assert sum(spread["served_per_replica"]) == REQUESTS
    assert all(count > 0 for count in spread["served_per_replica"]), spread["served_per_replica"]
    assert spread["tokens_differ_from_reference"] == []


def test_requests_spread_and_none_lost_when_a_replica_is_terminated(tmp_path):
    report = run_bench(tmp_path, "TERM")
    check_spread(report)
    kill = report["kill"]
    assert kill["lost"] == [], kill["lost"]
    assert kill["finished"] == REQUESTS
    assert kill["victim_exit_status"] == 0  # drained and stopped cleanly
    assert len(kill["served_by_survivors"]) == 2
    assert all(count > 0 for count in kill["served_by_survivors"].values()), kill["served_by_survivors"]
    assert kill["tokens_differ_from_reference"] == []


def test_a_killed_replica_loses_only_requests_that_had_streamed_tokens(tmp_path):
    report = run_bench(tmp_path, "KILL")
    check_spread(report)
    kill = report["kill"]
    assert kill["victim_exit_status"] == -9
    assert all(lost["tokens"] > 0 and lost["code"] == "UNAVAILABLE" for lost in kill["lost"]), kill["lost"]
    assert len(kill["lost"]) <= CONCURRENCY
    assert kill["tokens_differ_from_reference"] == []

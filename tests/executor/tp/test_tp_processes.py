"""The follower processes' life: a follower that dies while the group forms ends rank 0 at once with the
bad-setup status (instead of a wait of minutes), followers do not outlive a rank 0 killed with SIGKILL, and
SIGTERM stops rank 0 and its followers cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from executor_streams import generate, wait_serving
from server_processes import REPO_ROOT
from tp_executors import child_pids, spawn_tp_executor
from tp_greedy_run import greedy_outputs, load_request

from specdec.v1 import executor_pb2_grpc

EXIT_WAIT_S = 60.0  # no-hang bound, not a performance bar

START_WITH_DEAD_FOLLOWER = """
import types, torch
from executor_service.parallel import launcher
launcher.sys = types.SimpleNamespace(executable="/bin/false")  # every follower exits 1 at once
launcher.Followers(2, torch.device("cpu"), None)
print("the group formed without its follower")
"""


def test_a_follower_that_dies_at_start_ends_rank_0_with_bad_setup() -> None:
    run = subprocess.run(
        [sys.executable, "-c", START_WITH_DEAD_FOLLOWER],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=EXIT_WAIT_S,
        check=False,
    )
    assert run.returncode == 2, (run.stdout, run.stderr[-2000:])
    assert "tensor-parallel rank 1" in run.stderr and "exited with status 1 while starting" in run.stderr


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return status != "Z"  # a zombie has exited


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc for the follower's pid")
def test_followers_exit_when_rank_0_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    server = spawn_tp_executor(tmp_path, load_request("none"), 3)
    try:
        followers = []
        deadline = time.monotonic() + EXIT_WAIT_S
        while len(followers) < 2 and time.monotonic() < deadline:
            followers = child_pids(server.process.pid)
            time.sleep(0.05)
        assert len(followers) == 2, server.log()
    finally:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
    deadline = time.monotonic() + EXIT_WAIT_S
    while any(alive(pid) for pid in followers):
        assert time.monotonic() < deadline, f"followers {followers} outlived rank 0"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc for the followers' pids")
def test_sigterm_stops_rank_0_and_its_followers_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served tokens at TP 2 through gRPC, then SIGTERM: the model is unloaded on every rank, the followers get
    STOP and exit, and rank 0 exits 0."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    server = spawn_tp_executor(tmp_path, load_request("eagle3"), 2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            wait_serving(channel, server)
            followers = child_pids(server.process.pid)
            stub = executor_pb2_grpc.ExecutorStub(channel)
            responses = list(stub.Generate(generate("short", 5), timeout=EXIT_WAIT_S))
            assert sum(len(r.token_ids) for r in responses) == 5
            assert responses[-1].finished.finish_reason == "length"
    finally:
        status = server.stop()
    assert status == 0, server.log()[-3000:]
    assert len(followers) == 1 and not alive(followers[0])
    assert "could not stop the followers" not in server.log()


LOAD_FAILING_ON_RANK_0 = """
import json, sys, torch
sys.path[:0] = ["tests/executor/tp", "tests/executor"]
import tp_greedy_run
from executor_service.server import session
from executor_service.parallel import state
from executor_service.parallel.launcher import Followers

followers = Followers(2, torch.device("cpu"), None)
real = session.load_target_shard
def failing(*args, **kwargs):
    raise RuntimeError("injected: rank 0 cannot load")
session.load_target_shard = failing
try:
    tp_greedy_run.greedy_outputs("none")
except RuntimeError as err:
    print("load failed:", err, file=sys.stderr)
session.load_target_shard = real
print(json.dumps({"failure": state.get_tp_group().failure, "tokens": tp_greedy_run.greedy_outputs("none")}))
followers.stop()
"""


def test_a_load_that_fails_on_rank_0_leaves_the_ranks_in_step() -> None:
    """Rank 0's own load fails after the followers built theirs: they drop it, the group is not broken, and the
    next load serves the same tokens as one process."""
    run = subprocess.run(
        [sys.executable, "-c", LOAD_FAILING_ON_RANK_0],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=EXIT_WAIT_S * 5,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "load failed: injected: rank 0 cannot load" in run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["failure"] is None
    assert report["tokens"] == greedy_outputs("none")

"""Health tells the truth at tensor-parallel size 2 (CPU, real processes): a follower frozen with SIGSTOP turns
health NOT_SERVING within seconds (its heartbeat stops; the step watchdog bounds a step), the stream it stalls
ends with UNAVAILABLE and new requests are refused with UNAVAILABLE at once; a follower lost during LoadModel
leaves Generate UNAVAILABLE (not FAILED_PRECONDITION "no model is loaded"). Every wait is bounded; a failure
shows the executor's log, the followers' output included."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import grpc
import pytest
from executor_streams import RPC_TIMEOUT_S, Stream, generate, wait_serving
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_processes import ServerProcess, spawn_server
from tp_executors import child_pids, spawn_tp_executor
from tp_greedy_run import load_request

from specdec.v1 import executor_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FLIP_BOUND_S = 30.0  # no-hang bound with a 2 s heartbeat timeout, not a performance bar
FAST_WATCHDOG = {"SPECDEC_TP_HEARTBEAT_TIMEOUT_S": "2", "SPECDEC_TP_STEP_WATCHDOG_S": "4", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc for the follower's pid")


@contextmanager
def stopped_server(server: ServerProcess, follower: list[int]) -> Iterator[None]:
    """On the way out: the frozen follower continued (so SIGTERM and the server's stop reach it), the server
    stopped within its bound; the server's log on any failure."""
    try:
        yield
    except BaseException:
        print(server.log()[-6000:])
        raise
    finally:
        for pid in follower:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop()
        if server.killed:
            for pid in follower:  # the server was SIGKILLed: its followers go with PR_SET_PDEATHSIG, or here
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def wait_not_serving(channel: grpc.Channel, server: ServerProcess) -> float:
    """Seconds until health says NOT_SERVING (at most FLIP_BOUND_S)."""
    health = health_pb2_grpc.HealthStub(channel)
    started = time.monotonic()
    while health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status != NOT_SERVING:
        assert time.monotonic() - started < FLIP_BOUND_S, f"health still SERVING:\n{server.log()[-4000:]}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_frozen_follower_turns_health_not_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FAST_WATCHDOG.items():
        monkeypatch.setenv(name, value)
    request = load_request("none")
    request.num_kv_blocks = 512
    server = spawn_tp_executor(tmp_path, request, 2)
    frozen: list[int] = []
    with stopped_server(server, frozen), grpc.insecure_channel(server.address) as channel:
        wait_serving(channel, server)
        (follower,) = child_pids(server.process.pid)
        stub = executor_pb2_grpc.ExecutorStub(channel)
        stream = Stream(stub, "long")
        stream.start()
        assert stream.first.wait(FLIP_BOUND_S) and stream.error is None, stream.error
        os.kill(follower, signal.SIGSTOP)
        frozen.append(follower)
        wait_not_serving(channel, server)
        stream.join(FLIP_BOUND_S)
        assert not stream.is_alive(), "the stream still waits on a frozen rank"
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert "rank 1" in (stream.error.details() or ""), stream.error.details()
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate("after", 4), timeout=RPC_TIMEOUT_S))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "has not answered" in (refused.value.details() or ""), refused.value.details()
    assert "rank 1" in server.log() and "has not answered" in server.log()
    assert "Python stacks of rank 0" in server.log()  # the watchdog says where rank 0 was (stack_dumps.py)


def test_generate_after_a_follower_lost_during_load_model_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower is frozen before LoadModel (so its load cannot finish), then killed while rank 0 waits on it."""
    for name, value in FAST_WATCHDOG.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPECDEC_TP_HEARTBEAT_TIMEOUT_S", "60")  # the kill, not the heartbeat, fails this load
    server = spawn_server("executor", "tp", tmp_path, "--device", "cpu", "--tensor-parallel-size", "2")
    frozen: list[int] = []
    with stopped_server(server, frozen), grpc.insecure_channel(server.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        deadline = time.monotonic() + FLIP_BOUND_S
        while len(followers := child_pids(server.process.pid)) < 1:
            assert time.monotonic() < deadline, server.log()[-4000:]
            time.sleep(0.05)
        (follower,) = followers
        os.kill(follower, signal.SIGSTOP)
        frozen.append(follower)
        outcome: list[grpc.RpcError | object] = []
        loading = threading.Thread(
            target=lambda: outcome.append(_call(lambda: stub.LoadModel(load_request("none"), timeout=FLIP_BOUND_S))),
            daemon=True,
        )
        loading.start()
        time.sleep(0.5)  # LoadModel reaches rank 0's wait on the frozen rank
        os.kill(follower, signal.SIGKILL)
        loading.join(FLIP_BOUND_S + 5)
        assert outcome, "LoadModel still waits on a dead rank"
        (error,) = outcome
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate("after", 4), timeout=RPC_TIMEOUT_S))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "tensor parallelism is broken" in (refused.value.details() or ""), refused.value.details()
        wait_not_serving(channel, server)


def _call(call: object) -> grpc.RpcError | object:
    """The call's result, or the RpcError it raised."""
    try:
        return call()  # type: ignore[operator]
    except grpc.RpcError as err:
        return err

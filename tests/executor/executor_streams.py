"""Executor server processes and Generate streams on threads, for the tests that kill a server under live streams
(imported as `executor_streams`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_processes import ServerProcess

from specdec.v1 import executor_pb2, executor_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
MAX_TOKENS = 1500  # far more than the CPU makes before the kill

# No-hang bounds, not performance bars: a stream's deadline is far longer than the wait for its end after the
# kill, so a client left hanging shows as a stream still open, not as DEADLINE_EXCEEDED.
STREAM_DEADLINE_S = 300.0
END_AFTER_KILL_S = 30.0
LOAD_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 10.0


def wait_serving(channel: grpc.Channel, server: ServerProcess) -> None:
    """Until health says SERVING (its --load has finished); fails if the process exits first."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"the executor exited:\n{server.log()}"
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status == SERVING:
                return
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # UNAVAILABLE: not listening yet
        time.sleep(0.05)
    raise AssertionError(f"the executor was not SERVING within {LOAD_TIMEOUT_S} s:\n{server.log()}")


def generate(request_id: str, max_tokens: int) -> executor_pb2.GenerateRequest:
    return executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=[5, 3, 1, 4]),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


class Stream(threading.Thread):
    """Reads one Generate stream to its end on its own thread; `first` is set once a chunk has arrived."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub, request_id: str) -> None:
        super().__init__(daemon=True)
        self.call = stub.Generate(generate(request_id, MAX_TOKENS), timeout=STREAM_DEADLINE_S)
        self.first = threading.Event()
        self.tokens = 0
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for response in self.call:
                self.tokens += len(response.token_ids)
                self.first.set()
        except grpc.RpcError as err:
            self.error = err
        self.first.set()

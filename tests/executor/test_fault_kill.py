"""A crash of the executor process (kill -9, as the OOM killer does it) with live streams: every client gets
UNAVAILABLE instead of waiting on a dead server, the selector it loaded its model through keeps serving, and the
executor restarted on the same port serves the same client channel again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from executor_builders import load_request
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_processes import ServerProcess
from spec_builders import draft_model

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc, selector_pb2, selector_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NUM_STREAMS = 4
NUM_KV_BLOCKS = 512  # 16 tokens each: room for every stream's whole max_tokens
MAX_TOKENS = 1500  # far more than the CPU makes before the kill
# No-hang bounds, not performance bars: a stream's deadline is far longer than the wait for its end after the
# kill, so a client left hanging shows as a stream still open, not as DEADLINE_EXCEEDED.
STREAM_DEADLINE_S = 300.0
END_AFTER_KILL_S = 30.0
LOAD_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 10.0
KNOWN_GOOD_SELECTION = selector_pb2.SelectBackendsRequest(
    hardware=common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_CPU, libraries=[common_pb2.KernelLibrary(name="torch", version="2.13.0")]
    ),
    target_layers=common_pb2.LayerSpec(head_size=32, num_heads=4, num_kv_heads=2, dtype=common_pb2.DTYPE_FLOAT32),
)


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


def test_kill_9_with_live_streams_then_restart(
    launch_server: Callable[..., ServerProcess], selector_server: ServerProcess, tmp_path: Path
) -> None:
    load = load_request(num_kv_blocks=NUM_KV_BLOCKS)
    load.draft.CopyFrom(draft_model("eagle3", 3))
    load_file = tmp_path / "load.json"
    load_file.write_text(json_format.MessageToJson(load))
    args = ("--device", "cpu", "--load", str(load_file), "--selector-address", selector_server.address)
    executor = launch_server("executor", *args)
    selector = grpc.insecure_channel(selector_server.address)
    channel = grpc.insecure_channel(executor.address)
    stub = executor_pb2_grpc.ExecutorStub(channel)
    wait_serving(channel, executor)

    streams = [Stream(stub, f"live-{i}") for i in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first.wait(LOAD_TIMEOUT_S), "a stream got no first chunk"
    assert all(s.error is None and s.tokens > 0 for s in streams), [s.error for s in streams]

    assert executor.kill() == -9
    for stream in streams:
        stream.join(END_AFTER_KILL_S)
    assert not any(s.is_alive() for s in streams), f"streams still open {END_AFTER_KILL_S} s after the kill"
    codes = [s.error.code() if s.error is not None else "ended normally" for s in streams]
    assert codes == [grpc.StatusCode.UNAVAILABLE] * NUM_STREAMS, codes
    assert all(s.tokens < MAX_TOKENS for s in streams)
    with_no_server = stub.GetModelInfo.future(executor_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert with_no_server.exception(END_AFTER_KILL_S).code() == grpc.StatusCode.UNAVAILABLE

    # The selector never noticed: it answers, and says SERVING.
    selection = selector_pb2_grpc.BackendSelectorStub(selector).SelectBackends(
        KNOWN_GOOD_SELECTION, timeout=RPC_TIMEOUT_S
    )
    assert selection.target.backend == "CPU_ATTN", selection
    health = health_pb2_grpc.HealthStub(selector).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
    assert health.status == SERVING

    # Restarted on the same port (loading through the selector again), the same channel serves again.
    restarted = launch_server("executor", *args, "--port", str(executor.port))
    assert restarted.port == executor.port
    wait_serving(channel, restarted)
    responses = list(stub.Generate(generate("after-restart", 32), timeout=STREAM_DEADLINE_S))
    assert sum(len(r.token_ids) for r in responses) == 32
    assert responses[-1].finished.finish_reason == "length", responses[-1]
    info = stub.GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S).info
    assert (info.num_kv_blocks, info.spec_method) == (NUM_KV_BLOCKS, common_pb2.SPEC_METHOD_EAGLE3), info
    channel.close()
    selector.close()
    assert restarted.stop() == 0, restarted.shutdown_failure()

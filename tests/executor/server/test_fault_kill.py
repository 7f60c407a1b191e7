"""A crash of the executor process (kill -9, as the OOM killer does it) with live streams: every client gets
UNAVAILABLE instead of waiting on a dead server, the selector it loaded its model through keeps serving, and the
executor restarted on the same port serves the same client channel again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from executor_builders import load_request
from executor_streams import (
    END_AFTER_KILL_S,
    LOAD_TIMEOUT_S,
    MAX_TOKENS,
    RPC_TIMEOUT_S,
    SERVING,
    STREAM_DEADLINE_S,
    Stream,
    generate,
    wait_serving,
)
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_processes import ServerProcess
from spec_builders import draft_model

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc, selector_pb2, selector_pb2_grpc

NUM_STREAMS = 4
NUM_KV_BLOCKS = 512  # 16 tokens each: room for every stream's whole max_tokens
KNOWN_GOOD_SELECTION = selector_pb2.SelectBackendsRequest(
    hardware=common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_CPU, libraries=[common_pb2.KernelLibrary(name="torch", version="2.13.0")]
    ),
    target_layers=common_pb2.LayerSpec(head_size=32, num_heads=4, num_kv_heads=2, dtype=common_pb2.DTYPE_FLOAT32),
)


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

"""`python -m executor_service.server.main` as a process on the CPU: --load at start, health, and SIGTERM, which
refuses new generations, aborts the running ones after --grace-seconds (their streams end cleanly with
finish_reason "abort") and exits 0."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from executor_builders import load_request
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import executor_pb2, executor_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "specdec.v1.Executor")
LOAD_TIMEOUT_S = 300.0  # a no-hang bound, not a performance bar
# Far more tokens than the CPU makes in the grace period, and cache for all of them: only the drain can end it.
MAX_TOKENS = 4000
NUM_KV_BLOCKS = 256  # 16 tokens each
GRACE_S = 1.0


def health(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def wait_for_health(channel: grpc.Channel, expected: int, server) -> None:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while (status := health(channel)) != expected:
        assert server.process.poll() is None, f"the executor exited:\n{server.log()}"
        assert time.monotonic() < deadline, f"health {status}, not {expected}, in {LOAD_TIMEOUT_S} s:\n{server.log()}"
        time.sleep(0.02)


def generate_request(request_id: str, max_tokens: int) -> executor_pb2.GenerateRequest:
    return executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=[1, 2, 3, 4, 5]),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens),
    )


def test_sigterm_aborts_running_streams_cleanly_and_exits_0(launch_executor, tmp_path: Path) -> None:
    load = tmp_path / "load.json"
    load.write_text(json_format.MessageToJson(load_request(num_kv_blocks=NUM_KV_BLOCKS)))
    server = launch_executor(load, "--grace-seconds", str(GRACE_S))
    with grpc.insecure_channel(server.address) as channel:
        wait_for_health(channel, SERVING, server)
        assert [health(channel, service) for service in SERVICES] == [SERVING, SERVING]
        stub = executor_pb2_grpc.ExecutorStub(channel)
        stream = stub.Generate(generate_request("long", MAX_TOKENS), timeout=30)
        first = next(stream)
        assert first.token_ids and not first.HasField("finished")

        server.terminate()
        # Draining: health goes NOT_SERVING at once and new generations are refused, while the running one goes on.
        wait_for_health(channel, NOT_SERVING, server)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate_request("late", 2), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "shutting down" in refused.value.details()

        responses = [first, *stream]  # raises if the stream breaks instead of ending
        assert stream.code() == grpc.StatusCode.OK, stream.details()

    assert [r.HasField("finished") for r in responses] == [False] * (len(responses) - 1) + [True]
    finished = responses[-1].finished
    token_ids = [t for r in responses for t in r.token_ids]
    assert finished.finish_reason == "abort", finished
    assert (finished.prompt_tokens, finished.completion_tokens) == (5, len(token_ids))
    assert 0 < len(token_ids) < MAX_TOKENS
    assert server.stop() == 0, server.shutdown_failure()
    assert "aborting 1 requests at shutdown" in server.log()


def test_without_a_model_health_is_not_serving_and_sigterm_exits_0(executor_server) -> None:
    with grpc.insecure_channel(executor_server.address) as channel:
        assert [health(channel, service) for service in SERVICES] == [NOT_SERVING, NOT_SERVING]
        with pytest.raises(grpc.RpcError) as err:
            executor_pb2_grpc.ExecutorStub(channel).GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert executor_server.stop() == 0, executor_server.shutdown_failure()

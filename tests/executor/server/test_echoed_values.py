"""LoadModel refusals that echo what was sent (a path, an architecture, a backend name) reach the client as
themselves, clipped, whatever the size of the value. They used to come back as RESOURCE_EXHAUSTED "metadata
size exceeds limit": the status echoed 6 KB in its trailers, twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import load_request

from executor_service.server.main import ExecutorOptions, start_executor
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

TIMEOUT_S = 60.0
VALUE = "é" * 2048 + "Q" * 2048  # 6 KB, half of it percent-encoded in grpc-message (9 bytes a character)


@pytest.fixture
async def stub(tmp_path: Path) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    running = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), model_root=tmp_path)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            yield executor_pb2_grpc.ExecutorStub(channel)
    finally:
        await running.stop(0)


def with_path() -> executor_pb2.LoadModelRequest:
    return executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path=VALUE))


def with_architecture() -> executor_pb2.LoadModelRequest:
    request = load_request()
    request.target.synthetic.architecture = VALUE
    return request


def with_backend() -> executor_pb2.LoadModelRequest:
    return load_request(backend=VALUE)


@pytest.mark.parametrize("build", [with_path, with_architecture, with_backend], ids=["path", "architecture", "backend"])
async def test_a_6_kb_value_is_refused_as_itself(stub, build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(build(), timeout=TIMEOUT_S)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:300]
    assert len(err.value.details().encode()) <= 1024
    assert VALUE not in err.value.details()

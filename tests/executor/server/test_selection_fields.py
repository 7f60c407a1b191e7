"""A LoadModel refused by backend selection names the LoadModel field the caller sent, whether the executor
selects in-process or asks a selector over gRPC: the selector judges a SelectBackendsRequest the executor
built, whose field names (speculative.attention_backend, target_layers...) the caller never used."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import load_request
from rpc_details import violated_fields
from spec_builders import draft_model

from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.selection import load_request_field
from selector_service.main import start_selector
from specdec.v1 import executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

TIMEOUT_S = 60.0


@pytest.fixture(params=["in-process", "selector over gRPC"])
async def stub(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    selector = await start_selector(ServerSettings(port=0)) if request.param != "in-process" else None
    address = f"127.0.0.1:{selector.port}" if selector is not None else None
    options = ExecutorOptions(device=torch.device("cpu"), model_root=tmp_path, selector_address=address)
    running = await start_executor(ServerSettings(port=0), options)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            yield executor_pb2_grpc.ExecutorStub(channel)
    finally:
        await running.stop(0)
        if selector is not None:
            await selector.stop(0)


async def test_a_drafter_backend_the_machine_lacks_is_named_as_sent(stub) -> None:  # type: ignore[no-untyped-def]
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.attention_backend = "FLASH_ATTN"  # no flash_attn on a CPU
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(request, timeout=TIMEOUT_S)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert violated_fields(err.value) == ["draft.attention_backend"]


@pytest.mark.parametrize(
    ("selector_field", "load_field"),
    [
        ("speculative.attention_backend", "draft.attention_backend"),
        ("speculative.dflash_config.block_size", "draft.dflash_config.block_size"),
        ("speculative.draft_layers.head_size", "draft.source"),
        ("target_layers.head_size", "target"),
        ("target_layers.dtype", "dtype"),
        ("attention.backend", "attention.backend"),
    ],
)
def test_selector_fields_map_to_load_request_fields(selector_field: str, load_field: str) -> None:
    assert load_request_field(selector_field) == load_field

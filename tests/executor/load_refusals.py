"""LoadModel refusals over gRPC on an in-process executor, the checks that it keeps serving afterwards, and drafter
checkpoints written to disk (imported as `load_refusals`: pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc
from spec_builders import draft_model

from executor_service.models.draft_models import TargetHeads
from executor_service.models.draft_weights import save_drafter, synthetic_drafter
from executor_service.server.drafting import resolve_draft
from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2, executor_pb2_grpc

CPU = torch.device("cpu")
SERVING = health_pb2.HealthCheckResponse.SERVING
RPC_TIMEOUT_S = 60.0  # generous: only there so that a regression fails instead of hanging


async def health(executor: RunningExecutor) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
        request = health_pb2.HealthCheckRequest(service="")
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=RPC_TIMEOUT_S)).status


async def generate(stub: executor_pb2_grpc.ExecutorStub, request_id: str, max_tokens: int) -> list[int]:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens),
    )
    return [t async for r in stub.Generate(request, timeout=RPC_TIMEOUT_S) for t in r.token_ids]


async def refusal(stub: executor_pb2_grpc.ExecutorStub, request: executor_pb2.LoadModelRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(request, timeout=RPC_TIMEOUT_S)
    return err.value


async def assert_still_serving(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, info: executor_pb2.ModelInfo, case: str
) -> None:
    assert await health(executor) == SERVING, case
    served = await stub.GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert served.info == info, case


def write_drafter(directory: Path, method: str = "eagle3") -> None:
    """A drafter checkpoint for the tiny target, in its published format."""
    target = tiny_model()
    draft = resolve_draft(draft_model(method, 3), target.config, None)
    heads = TargetHeads(target.model.embed_tokens, target.model.lm_head)
    save_drafter(synthetic_drafter(draft.config, heads, 7, torch.float32, CPU), target.config.num_layers, directory)

"""GenerateRequest.num_speculative_tokens through gRPC: concurrent streams with different values share the
executor's steps and each equals target-only greedy decoding with statistics for its own k; out-of-range
values are INVALID_ARGUMENT naming the field, also without a drafter."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from executor_builders import load_request
from greedy_reference import greedy_reference
from rpc_details import violations
from spec_builders import draft_model

from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2

WAIT_S = 300  # only so that a regression fails instead of hanging; no test asserts a duration
PROMPTS = {"unset": [5, 6, 7, 8], "plain": [9, 10, 11], "one": [12, 13, 14, 15, 16], "three": [17, 18]}
OWN_K = {"unset": None, "plain": 0, "one": 1, "three": 3}


def request(rid: str, ids: list[int], k: int | None, max_tokens: int = 10) -> executor_pb2.GenerateRequest:
    message = executor_pb2.GenerateRequest(request_id=rid, token_ids=executor_pb2.TokenIds(ids=ids))
    message.sampling.max_tokens = max_tokens
    if k is not None:
        message.num_speculative_tokens = k
    return message


async def collect(stub, message: executor_pb2.GenerateRequest) -> list[executor_pb2.GenerateResponse]:
    return await asyncio.wait_for(_responses(stub, message), WAIT_S)


async def _responses(stub, message: executor_pb2.GenerateRequest) -> list[executor_pb2.GenerateResponse]:
    return [response async for response in stub.Generate(message)]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
async def test_concurrent_streams_with_their_own_k(executor: RunningExecutor, stub, method: str) -> None:
    load = load_request()
    load.draft.CopyFrom(draft_model(method, 3))
    await stub.LoadModel(load)
    model = executor.servicer.session.loaded.model
    streams = await asyncio.gather(*(collect(stub, request(rid, PROMPTS[rid], OWN_K[rid])) for rid in PROMPTS))
    for rid, responses in zip(PROMPTS, streams, strict=True):
        assert [t for r in responses for t in r.token_ids] == greedy_reference(model, PROMPTS[rid], 10), rid
        k = 3 if OWN_K[rid] is None else OWN_K[rid]
        finished = responses[-1].finished  # (a response may carry several steps: no per-step count here)
        assert finished.finish_reason == "length" and finished.completion_tokens == 10
        assert finished.drafted_tokens == sum(r.num_drafted for r in responses) <= k * 9, rid
        assert len(finished.acceptance_rate_per_position) == k, rid
    plain = streams[list(PROMPTS).index("plain")][-1].finished
    assert plain.drafted_tokens == 0 and plain.mean_acceptance_length == 1.0


async def test_out_of_range_values_are_invalid_argument(executor: RunningExecutor, stub) -> None:
    load = load_request()
    load.draft.CopyFrom(draft_model("dflash", 3))  # block 4: at most 3 drafts
    await stub.LoadModel(load)
    for bad in (-1, 4, 2**31 - 1):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, request("bad", [1, 2, 3], bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must be in [0, 3]" in violations(err.value)["num_speculative_tokens"]
        assert f"got {bad}" in violations(err.value)["num_speculative_tokens"]
    assert len(await collect(stub, request("edge", [1, 2, 3], 3, max_tokens=4))) >= 1


async def test_without_a_drafter_only_zero_is_accepted(executor: RunningExecutor, stub) -> None:
    await stub.LoadModel(load_request())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, request("bad", [1, 2, 3], 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no drafter" in violations(err.value)["num_speculative_tokens"]
    model = executor.servicer.session.loaded.model
    responses = await collect(stub, request("plain", [1, 2, 3], 0, max_tokens=5))
    assert [t for r in responses for t in r.token_ids] == greedy_reference(model, [1, 2, 3], 5)

"""A speculative step holds KV slots past a request's tokens (the drafts it verifies, the drafter's lookahead):
admission counts them, so every request it lets in finishes, alone or crowded (preemption included), for
every method and k; a request that could never fit (one that skipped admission) fails clearly instead of
preempting itself forever. The exact report: DFlash k = 4, 64 blocks, a 1000-token prompt + 24 stalled the
executor at 20 tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest
import torch
from engine_driving import Outputs, run_bounded
from executor_builders import TINY, greedy, load_request
from greedy_reference import greedy_reference
from rpc_details import violations
from spec_builders import draft_model, spec_session

from executor_service.errors import RequestTooLarge
from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.session import EngineSettings, ModelSession
from executor_service.server.validation import check_generate
from executor_service.server.wire import status_error
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.errors import ResourceExhausted
from specdec_runtime.grpc_runtime import ServerSettings

BLOCKS, BLOCK_SIZE = 8, 16
CAPACITY = BLOCKS * BLOCK_SIZE
WAIT_S = 300  # only so that a regression fails instead of hanging; no test asserts a duration
CASES = [("eagle", 1), ("eagle", 4), ("eagle3", 2), ("eagle3", 6), ("dflash", 4), ("dflash", 7)]


def ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY["vocab_size"] - 1) for _ in range(count)]


def generate_request(prompt: list[int], max_tokens: int | None) -> executor_pb2.GenerateRequest:
    sampling = (
        executor_pb2.SamplingParams() if max_tokens is None else executor_pb2.SamplingParams(max_tokens=max_tokens)
    )
    return executor_pb2.GenerateRequest(request_id="r", token_ids=executor_pb2.TokenIds(ids=prompt), sampling=sampling)


def add(session: ModelSession, rid: str, prompt: list[int], max_tokens: int, outputs: Outputs) -> None:
    session.engine.add(session.new_request(rid, prompt, greedy(max_tokens), max_tokens, outputs))


@pytest.mark.parametrize(("method", "k"), CASES)
def test_admission_counts_the_speculative_headroom(method: str, k: int) -> None:
    session = spec_session(method, k, num_kv_blocks=BLOCKS)
    lookahead = session.engine.scheduler.num_lookahead_tokens
    headroom = session.limits.headroom_tokens
    assert lookahead > k and headroom == k + lookahead - 1
    prompt = ids(100, seed=k)
    with pytest.raises(ResourceExhausted) as err:  # prompt + max_tokens == the cache: it passed, then stalled
        check_generate(generate_request(prompt, CAPACITY - len(prompt)), session.limits, None)
    most = CAPACITY - headroom - len(prompt)
    assert [v.field for v in err.value.field_violations] == ["sampling.max_tokens"]
    assert f"at most {most} " in err.value.field_violations[0].description
    assert check_generate(generate_request(prompt, most), session.limits, None)[2] == most
    assert check_generate(generate_request(prompt, None), session.limits, None)[2] == most
    outputs = Outputs()
    add(session, "largest", prompt, most, outputs)
    run_bounded(session.engine)
    assert outputs.tokens("largest") == greedy_reference(session.loaded.model, prompt, most)
    assert outputs.finish_reason("largest") == "length"
    assert session.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize(("method", "k"), CASES)
def test_admitted_requests_finish_when_they_crowd_the_cache(method: str, k: int) -> None:
    """Three requests that each fit alone, together: they preempt one another and all finish exactly."""
    session = spec_session(method, k, num_kv_blocks=BLOCKS)
    prompts = {f"r{i}": ids(40 + 10 * i, seed=i) for i in range(3)}
    outputs, most = Outputs(), {}
    for rid, prompt in prompts.items():
        most[rid] = check_generate(generate_request(prompt, None), session.limits, None)[2]
        add(session, rid, prompt, most[rid], outputs)
    run_bounded(session.engine)
    assert sum(len(p) + most[rid] for rid, p in prompts.items()) > CAPACITY  # they cannot all run at once
    for rid, prompt in prompts.items():
        assert outputs.tokens(rid) == greedy_reference(session.loaded.model, prompt, most[rid]), rid
    assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0


@pytest.mark.parametrize(("method", "k"), CASES)
def test_a_request_that_can_never_fit_fails_instead_of_spinning(method: str, k: int) -> None:
    """Past admission (warm-up, benchmarks, a bug): alone in the cache and unable to grow, a request is failed
    with RESOURCE_EXHAUSTED, once admitted (it outgrows the cache while decoding) or before (its prompt and
    lookahead never fit); the engine then serves the next request."""
    session = spec_session(method, k, num_kv_blocks=BLOCKS)
    outputs = Outputs()
    prompt = ids(100, seed=1)
    add(session, "outgrows", prompt, CAPACITY - len(prompt), outputs)
    run_bounded(session.engine)
    add(session, "never-admitted", ids(CAPACITY - 1, seed=2), 1, outputs)
    run_bounded(session.engine)
    for rid in ("outgrows", "never-admitted"):
        error = outputs.error(rid)
        assert isinstance(error, RequestTooLarge), (rid, error)
        assert "lookahead" in error.message and error.field == "sampling.max_tokens"
        status = status_error(error)  # what the server answers it with
        assert isinstance(status, ResourceExhausted) and status.message == error.message
        assert [v.field for v in status.field_violations] == ["sampling.max_tokens"]
    assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0
    add(session, "after", [1, 2, 3], 6, outputs)
    run_bounded(session.engine)
    assert outputs.tokens("after") == greedy_reference(session.loaded.model, [1, 2, 3], 6)


async def test_the_reported_request_is_refused_and_the_largest_one_finishes_over_grpc() -> None:
    """The report's exact request: tiny target, DFlash k = 4, 64 blocks; 1000 x [7] + 24 tokens."""
    running = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8))
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            request = load_request(num_kv_blocks=64)
            request.draft.CopyFrom(draft_model("dflash", 4))
            await stub.LoadModel(request)

            async def generate(rid: str, prompt: list[int], max_tokens: int | None) -> list[int]:
                message = generate_request(prompt, max_tokens)
                message.request_id = rid
                responses = await asyncio.wait_for(_collect(stub.Generate(message)), WAIT_S)
                assert responses[-1].finished.finish_reason == "length"
                return [t for r in responses for t in r.token_ids]

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate("reported", [7] * 1000, 24)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at most 16 " in violations(err.value)["sampling.max_tokens"]
            assert len(await generate("largest", [7] * 1000, 16)) == 16
            assert len(await generate("unset", [7] * 1000, None)) == 16
            assert len(await generate("later", [1, 2, 3], 8)) == 8
            session = running.servicer.session
            assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0
    finally:
        await running.stop(0.5)


async def test_a_request_failed_mid_stream_for_the_cache_is_resource_exhausted_over_grpc() -> None:
    """A request that outgrows the whole cache while decoding (admission told it could fit: here its limits are
    loosened, as for a request that skipped admission) ends its stream RESOURCE_EXHAUSTED, naming
    sampling.max_tokens, not INTERNAL; the next request is served."""
    running = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8))
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            await stub.LoadModel(load_request(num_kv_blocks=BLOCKS, block_size=BLOCK_SIZE))
            session = running.servicer.session
            session.limits = dataclasses.replace(session.limits, capacity_tokens=10 * CAPACITY)
            message = generate_request(ids(100, seed=3), CAPACITY)
            message.request_id = "outgrows"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(_collect(stub.Generate(message)), WAIT_S)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert f"the whole cache holds {CAPACITY}" in err.value.details()
            assert violations(err.value) == {"sampling.max_tokens": "more tokens than the whole KV cache holds"}
            after = generate_request([1, 2, 3], 4)
            after.request_id = "after"
            responses = await asyncio.wait_for(_collect(stub.Generate(after)), WAIT_S)
            assert [t for r in responses for t in r.token_ids] == greedy_reference(session.loaded.model, [1, 2, 3], 4)
            assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0
    finally:
        await running.stop(0.5)


async def _collect(stream: object) -> list[executor_pb2.GenerateResponse]:
    return [response async for response in stream]  # type: ignore[attr-defined]

"""Prefix caching through gRPC: LoadModelRequest.enable_prefix_caching (unset: on) and ModelInfo.prefix_caching,
Finished.cached_prompt_tokens, GetLoads' and the metrics' counts; the same tokens with it on and off."""

from __future__ import annotations

import asyncio
import random

from executor_builders import load_request
from greedy_reference import greedy_reference
from grpc_calls import generate, sample, scrape
from spec_builders import draft_model

from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2

BLOCK = 16
MAX_TOKENS = 6


def prompts() -> dict[str, list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(1, 500) for _ in range(2 * BLOCK + 1)]  # EAGLE's keys reach one token past a block
    return {rid: system + [rng.randrange(1, 500) for _ in range(5)] for rid in ("first", "second", "third")}


async def run(stub, caching: bool | None) -> tuple[executor_pb2.LoadModelResponse, dict[str, list]]:
    request = load_request(num_kv_blocks=64, block_size=BLOCK)
    request.draft.CopyFrom(draft_model("eagle3", 3))
    if caching is not None:
        request.enable_prefix_caching = caching
    loaded = await stub.LoadModel(request)
    batch = prompts()
    first = await generate(stub, "first", batch.pop("first"), max_tokens=MAX_TOKENS)
    rest = await asyncio.gather(*(generate(stub, rid, ids, max_tokens=MAX_TOKENS) for rid, ids in batch.items()))
    return loaded, dict(zip(["first", *batch], [first, *rest], strict=True))


def tokens(responses: list) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_prefix_caching_on_by_default_and_off_on_request(executor: RunningExecutor, stub) -> None:
    loaded, cached = await run(stub, None)
    assert loaded.info.prefix_caching
    model = executor.servicer.session.loaded.model
    for rid, ids in prompts().items():
        assert tokens(cached[rid]) == greedy_reference(model, ids, MAX_TOKENS), rid
    assert [cached[rid][-1].finished.cached_prompt_tokens for rid in cached] == [0, 2 * BLOCK, 2 * BLOCK]
    queries = sum(len(ids) for ids in prompts().values())
    loads = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert (loads.prefix_cache_queries, loads.prefix_cache_hits) == (queries, 4 * BLOCK)
    assert loads.prefix_cache_hit_rate == 4 * BLOCK / queries and loads.cached_free_kv_blocks >= 2
    metrics = await scrape(executor)
    assert sample(metrics, "specdec_prefix_cache_hits") == 4 * BLOCK
    assert sample(metrics, "specdec_prefix_cache_hit_rate") == 4 * BLOCK / queries
    assert sample(metrics, "specdec_kv_blocks_cached_free") == loads.cached_free_kv_blocks

    loaded, plain = await run(stub, False)
    assert not loaded.info.prefix_caching
    for rid in cached:
        assert tokens(plain[rid]) == tokens(cached[rid]), rid
        assert plain[rid][-1].finished.cached_prompt_tokens == 0
    loads = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert (loads.prefix_cache_queries, loads.prefix_cache_hits, loads.cached_free_kv_blocks) == (0, 0, 0)
    assert sample(await scrape(executor), "specdec_prefix_cache_hit_rate") == 0

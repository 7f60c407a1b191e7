"""GetServerInfo and GetLoads over gRPC: versions, capabilities, limits and uptime before and after a load;
running and queued requests and KV blocks while generations run; token totals, tokens/s and prefix-cache
counts after them."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time

import grpc
import pytest
import torch
from executor_builders import load_request
from spec_builders import draft_model

from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2


async def generate(stub, request_id: str, ids: list[int], max_tokens: int) -> list[executor_pb2.GenerateResponse]:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=ids),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return [r async for r in stub.Generate(request)]


async def test_server_info_before_and_after_a_load(executor: RunningExecutor, stub) -> None:
    before = await stub.GetServerInfo(executor_pb2.GetServerInfoRequest())
    assert not before.model_loaded and not before.HasField("info") and before.max_prompt_tokens == 0
    assert before.server_version == importlib.metadata.version("specdec")
    assert (before.torch_version, before.grpc_version) == (torch.__version__, grpc.__version__)
    assert before.capabilities == await stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest())
    assert (before.max_batch_size, before.max_queued_requests) == (8, 16)  # the fixture's max_num_seqs, live limit
    assert before.uptime_seconds > 0 and 0 < before.started_unix_ms <= time.time() * 1000

    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    loaded = await stub.LoadModel(request)
    after = await stub.GetServerInfo(executor_pb2.GetServerInfoRequest())
    assert after.model_loaded and after.info == loaded.info
    assert after.target_backend == loaded.target_backend and after.draft_backend == loaded.draft_backend
    assert after.max_prompt_tokens == loaded.info.max_model_len - 1
    assert after.uptime_seconds >= before.uptime_seconds and after.started_unix_ms == before.started_unix_ms


async def test_loads_follow_the_work(executor: RunningExecutor, stub) -> None:
    empty = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert empty == executor_pb2.GetLoadsResponse()  # no model: nothing running, nothing counted
    await stub.LoadModel(load_request())
    idle = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert idle.num_kv_blocks == 64 and idle.used_kv_blocks == 0 and idle.generation_tokens_total == 0

    # Ten long requests on a cache of 64 blocks of 16 tokens, 8 at most in the batch: some run, some queue.
    streams = [asyncio.ensure_future(generate(stub, f"busy{i}", [3 + i] * 20, 400)) for i in range(10)]
    seen_running = seen_queued = False
    deadline = time.monotonic() + 120  # only against hanging
    while not (seen_running and seen_queued) and time.monotonic() < deadline:
        busy = await stub.GetLoads(executor_pb2.GetLoadsRequest())
        assert busy.running_requests + busy.queued_requests <= 10
        if busy.running_requests:
            assert 0 < busy.used_kv_blocks <= 64
            assert busy.kv_cache_usage == pytest.approx(busy.used_kv_blocks / 64)
            seen_running = True
        seen_queued |= busy.queued_requests > 0
        await asyncio.sleep(0.005)
    assert seen_running and seen_queued
    await stub.Abort(executor_pb2.AbortRequest(request_ids=[f"busy{i}" for i in range(10)]))
    aborted = await asyncio.gather(*streams)

    prompt = list(range(1, 41))  # two and a half blocks: the second run finds two of them cached
    done = [await generate(stub, "a", prompt, 5), await generate(stub, "b", prompt, 5)]
    after = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert (after.running_requests, after.queued_requests, after.used_kv_blocks) == (0, 0, 0)
    completions = [r[-1].finished.completion_tokens for r in aborted + done]
    assert after.generation_tokens_total >= sum(completions) > 0  # aborted streams may stop short of the engine
    assert after.prompt_tokens_total == 10 * 20 + 2 * 40
    assert after.generation_tokens_per_second > 0
    stats = executor.servicer.session.prefix_cache_stats()
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (stats.queries, stats.hits)
    assert after.prefix_cache_hits >= 32  # "b" reused "a"'s two full blocks
    assert after.cached_free_kv_blocks == stats.cached_free_blocks
    assert after.prefix_cache_hit_rate == pytest.approx(stats.hits / stats.queries if stats.queries else 0.0)

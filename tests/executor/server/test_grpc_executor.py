"""The Executor over gRPC, in-process on a free port: health transitions, LoadModel (synthetic, paths under
the model root, the selector remote or in-process), streaming Generate against the reference, Abort,
client cancel, bad inputs with field details, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import load_request, tiny_config
from greedy_reference import greedy_reference
from grpc_calls import Samples, generate, sample, scrape
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rpc_details import violations

from executor_service.models.loader import build_synthetic, save_directory
from executor_service.server.main import ExecutorOptions, RunningExecutor, start_executor
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

CPU = torch.device("cpu")


async def health(executor: RunningExecutor) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return response.status


async def test_health_load_info_and_generation(executor: RunningExecutor, stub) -> None:
    assert await health(executor) == health_pb2.HealthCheckResponse.NOT_SERVING
    capabilities = await stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest())
    assert capabilities.platform == common_pb2.PLATFORM_CPU
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetModelInfo(executor_pb2.GetModelInfoRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, "early", [1, 2, 3], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    loaded = await stub.LoadModel(load_request("qwen3"))
    assert loaded.target_backend.backend == "CPU_ATTN" and not loaded.target_backend.explicit
    assert loaded.target_backend.candidates[0].backend == "CPU_ATTN"
    assert loaded.info.num_kv_blocks == 64 and loaded.info.architecture == "qwen3"
    assert await health(executor) == health_pb2.HealthCheckResponse.SERVING
    info = await stub.GetModelInfo(executor_pb2.GetModelInfoRequest())
    assert info.info == loaded.info and info.target_backend == loaded.target_backend

    model = executor.servicer.session.loaded.model
    prompts = {f"g{i}": list(range(i + 3, 5 * i + 20)) for i in range(4)}
    streams = await asyncio.gather(*(generate(stub, rid, ids, max_tokens=9) for rid, ids in prompts.items()))
    for (rid, ids), responses in zip(prompts.items(), streams, strict=True):
        assert all(r.request_id == rid for r in responses)
        assert [t for r in responses for t in r.token_ids] == greedy_reference(model, ids, 9)
        assert [r.HasField("finished") for r in responses] == [False] * (len(responses) - 1) + [True]
        finished = responses[-1].finished
        assert (finished.finish_reason, finished.prompt_tokens, finished.completion_tokens) == ("length", len(ids), 9)
    assert executor.servicer.session.kv_cache.allocator.num_used == 0


async def test_bad_generate_requests_name_their_fields(executor: RunningExecutor, stub) -> None:
    await stub.LoadModel(load_request())
    cases = [
        (dict(request_id="a", token_ids=executor_pb2.TokenIds(ids=[])), {"token_ids"}),
        (dict(request_id="b", token_ids=executor_pb2.TokenIds(ids=[1, 512, -1])), {"token_ids.ids"}),
        (dict(request_id="c", token_ids=executor_pb2.TokenIds(ids=[1] * 9000)), {"token_ids"}),
        (dict(request_id="d", text="hello"), {"text"}),
        (dict(token_ids=executor_pb2.TokenIds(ids=[1])), {"request_id"}),
        (dict(request_id="e"), {"input"}),
        (
            dict(
                request_id="f",
                token_ids=executor_pb2.TokenIds(ids=[1]),
                sampling=executor_pb2.SamplingParams(max_tokens=0, temperature=-1, top_p=1.5, top_k=-2),
            ),
            {"sampling.max_tokens", "sampling.temperature", "sampling.top_p", "sampling.top_k"},
        ),
        (
            dict(
                request_id="g", token_ids=executor_pb2.TokenIds(ids=[1]), sampling=executor_pb2.SamplingParams(top_p=0)
            ),
            {"sampling.top_p"},
        ),
        (
            dict(
                request_id="h",
                token_ids=executor_pb2.TokenIds(ids=[1] * 10),
                sampling=executor_pb2.SamplingParams(max_tokens=8190),
            ),
            {"sampling.max_tokens"},
        ),
    ]
    for fields, expected in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in stub.Generate(executor_pb2.GenerateRequest(**fields))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert set(violations(err.value)) == expected, (fields, violations(err.value))
    # Still serving, nothing held.
    assert len(await generate(stub, "ok", [1, 2], max_tokens=2)) >= 1
    assert executor.servicer.session.kv_cache.allocator.num_used == 0


async def test_more_than_the_cache_is_resource_exhausted(tmp_path: Path) -> None:
    running = await start_executor(ServerSettings(port=0), ExecutorOptions(device=CPU))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            await stub.LoadModel(load_request(num_kv_blocks=4))  # 64 tokens in all
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, "big", list(range(40)), max_tokens=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "sampling.max_tokens" in violations(err.value)
            unset = await generate(stub, "fits", list(range(40)))  # max_tokens unset: what the cache allows
            assert unset[-1].finished.completion_tokens == 24 and unset[-1].finished.finish_reason == "length"
    finally:
        await running.stop(0.5)


async def test_duplicate_ids_abort_and_cancel(executor: RunningExecutor, stub) -> None:
    await stub.LoadModel(load_request(num_kv_blocks=64))
    request = executor_pb2.GenerateRequest(request_id="dup", token_ids=executor_pb2.TokenIds(ids=[5, 6, 7]))
    stream = stub.Generate(request)
    first = await stream.read()
    assert first.token_ids
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, "dup", [1], max_tokens=1)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in violations(err.value)
    aborted = await stub.Abort(executor_pb2.AbortRequest(request_ids=["dup", "nope"]))
    assert list(aborted.aborted_request_ids) == ["dup"]
    last = first
    while (response := await stream.read()) is not grpc.aio.EOF:
        last = response
    assert last.finished.finish_reason == "abort"
    session = executor.servicer.session
    assert session.kv_cache.allocator.num_used == 0

    cancelled = stub.Generate(executor_pb2.GenerateRequest(request_id="c", token_ids=executor_pb2.TokenIds(ids=[9])))
    await cancelled.read()
    cancelled.cancel()
    for _ in range(100):
        if not session.engine.num_live:
            break
        await asyncio.sleep(0.05)
    assert session.engine.num_live == 0 and session.kv_cache.allocator.num_used == 0


async def test_load_paths_stay_under_the_model_root(executor: RunningExecutor, stub, tmp_path: Path) -> None:
    save_directory(build_synthetic(tiny_config(), 5, torch.float32, CPU).model, tmp_path / "tiny")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    save_directory(build_synthetic(tiny_config(), 5, torch.float32, CPU).model, outside)
    bad = {
        "../x": "'..' is not allowed",
        "tiny/../tiny": "'..' is not allowed",
        str(outside): f"outside the model root '{tmp_path.resolve()}'",
        "missing": f"'missing' is not a directory under the model root '{tmp_path.resolve()}'",
        "broken": "config",
    }
    for path, message in bad.items():
        request = executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path=path), num_kv_blocks=8)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.LoadModel(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        assert message in err.value.details(), (path, err.value.details())
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path="link")))
    assert "outside the model root" in err.value.details()
    loaded = await stub.LoadModel(
        executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path="tiny"), num_kv_blocks=8)
    )
    assert loaded.info.architecture == "llama" and loaded.info.dtype == common_pb2.DTYPE_FLOAT32


async def test_load_refusals(executor: RunningExecutor, stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(executor_pb2.LoadModelRequest(block_size=20, num_kv_blocks=-1, gpu_memory_utilization=2))
    assert set(violations(err.value)) == {"target", "block_size", "num_kv_blocks", "gpu_memory_utilization"}
    synthetic = load_request()
    synthetic.target.synthetic.num_kv_heads = 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(synthetic)
    assert "target.synthetic.num_kv_heads" in violations(err.value)
    explicit = load_request(backend="FLASH_ATTN")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(explicit)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("Selected backend FLASH_ATTN is not valid for this configuration. Reason:")
    drafted = load_request()
    drafted.draft.method = common_pb2.SPEC_METHOD_EAGLE
    drafted.draft.num_speculative_tokens = -1
    drafted.draft.dflash_config.block_size = 4
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(drafted)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"draft.source", "draft.num_speculative_tokens", "draft.dflash_config"} <= set(violations(err.value))
    assert await health(executor) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_backends_from_a_remote_selector(selector_address: str) -> None:
    running = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=CPU, selector_address=selector_address)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            loaded = await stub.LoadModel(load_request(backend="flex_attention"))
            assert loaded.target_backend.backend == "FLEX_ATTENTION" and loaded.target_backend.explicit
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadModel(load_request(backend="FLASH_ATTN"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "attention.backend" in violations(err.value)  # the selector's details, passed on
            responses = await generate(stub, "remote", [1, 2, 3], max_tokens=3)
            assert responses[-1].finished.completion_tokens == 3
    finally:
        await running.stop(0.5)


METRICS_WAIT_S = 60.0  # a no-hang bound, not a performance bar


def rpcs(samples: Samples, method: str, code: str = "OK") -> float:
    return sample(samples, "specdec_rpc_requests_total", service="executor", method=method, code=code)


async def scrape_after(executor: RunningExecutor, method: str, count: float) -> Samples:
    """The metrics once `method` has `count` OK RPCs: a stream's handler (and its metrics) finishes just after
    the client has its last message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + METRICS_WAIT_S
    while rpcs(samples := await scrape(executor), method) < count and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return samples


async def test_metrics_count_the_work_done(executor: RunningExecutor, stub) -> None:
    """Known work moves each metric by a known amount: tokens, steps, RPCs; the queue, the running batch and
    the KV blocks are back to empty once the request finishes."""
    before = await scrape(executor)
    assert sample(before, "specdec_kv_blocks_total") == 0  # no model yet
    await stub.LoadModel(load_request(num_kv_blocks=64))
    responses = await generate(stub, "m", [1, 2, 3, 4], max_tokens=5)
    finished = responses[-1].finished
    assert (finished.prompt_tokens, finished.completion_tokens) == (4, 5)
    after = await scrape_after(executor, "Generate", 1)

    def rose(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert rose("specdec_generated_tokens_total") == 5
    assert rose("specdec_computed_tokens_total") == 4 + 5 - 1  # the prompt, then each token but the last
    steps = rose("specdec_step_latency_seconds_count")
    assert steps >= 5, "one request samples at most one token per step without a drafter"
    assert rose("specdec_step_latency_seconds_sum") > 0
    assert sample(after, "specdec_step_latency_seconds_bucket", le="+Inf") == sample(
        after, "specdec_step_latency_seconds_count"
    )
    assert (rpcs(after, "Generate"), rpcs(after, "LoadModel")) == (1, 1)
    assert sample(after, "specdec_rpc_latency_seconds_count", service="executor", method="Generate") == 1
    assert not [key for key, value in after.items() if key[0] == "specdec_rpc_errors_total" and value]
    assert sample(after, "specdec_kv_blocks_total") == 64
    for idle in ("specdec_kv_blocks_used", "specdec_queue_depth", "specdec_running_requests"):
        assert sample(after, idle) == 0, idle
    assert sample(after, "specdec_generation_tokens_per_second") >= 0
    assert rose("specdec_draft_tokens_total") == 0 and sample(after, "specdec_mean_acceptance_length") == 0

    await generate(stub, "m2", [7, 8], max_tokens=3)
    again = await scrape_after(executor, "Generate", 2)
    assert sample(again, "specdec_generated_tokens_total") - sample(after, "specdec_generated_tokens_total") == 3


async def test_text_in_text_out_with_the_checkpoints_tokenizer(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    save_directory(build_synthetic(tiny_config(), 4, torch.float32, CPU).model, tmp_path / "worded")
    vocab = {f"w{i}": i for i in range(tiny_config().vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tokenizer.save(str(tmp_path / "worded" / "tokenizer.json"))
    loaded = await stub.LoadModel(
        executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path="worded"), num_kv_blocks=16)
    )
    assert loaded.info.has_tokenizer
    request = executor_pb2.GenerateRequest(
        request_id="t", text="w5 w9 w33", sampling=executor_pb2.SamplingParams(max_tokens=6)
    )
    responses = [r async for r in stub.Generate(request)]
    tokens = [t for r in responses for t in r.token_ids]
    model = executor.servicer.session.loaded.model
    assert tokens == greedy_reference(model, [5, 9, 33], 6)
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)
    assert responses[-1].finished.prompt_tokens == 3


async def test_speculative_generation_over_grpc(executor: RunningExecutor, stub) -> None:
    """A drafter in LoadModel: its own backend decision comes back, streams carry drafted / accepted counts,
    the final message the acceptance statistics, and the metrics count them."""
    from spec_builders import ReplayDrafts, draft_model

    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    loaded = await stub.LoadModel(request)
    assert loaded.draft_backend.backend == "CPU_ATTN" and loaded.draft_backend.use_non_causal
    assert (loaded.info.spec_method, loaded.info.num_speculative_tokens) == (common_pb2.SPEC_METHOD_DFLASH, 3)
    info = await stub.GetModelInfo(executor_pb2.GetModelInfoRequest())
    assert info.draft_backend == loaded.draft_backend
    session = executor.servicer.session
    ids = [5, 6, 7, 8, 9]
    expected = greedy_reference(session.loaded.model, ids, 16)
    # Drafts the target's own continuation with the second one wrong: each verify step accepts exactly one.
    session.proposer.replay = ReplayDrafts({"spec": expected}, tiny_config().vocab_size, wrong_at=1)
    responses = await generate(stub, "spec", ids, max_tokens=16)
    assert [t for r in responses for t in r.token_ids] == expected
    finished = responses[-1].finished
    assert finished.drafted_tokens == sum(r.num_drafted for r in responses) > 0
    assert finished.accepted_tokens == sum(r.num_accepted for r in responses)
    assert finished.mean_acceptance_length >= 1.0 and len(finished.acceptance_rate_per_position) == 3
    samples = await scrape_after(executor, "Generate", 1)
    assert sample(samples, "specdec_draft_tokens_total") == finished.drafted_tokens
    assert sample(samples, "specdec_accepted_tokens_total") == finished.accepted_tokens
    verify_steps = sample(samples, "specdec_verify_steps_total")
    assert finished.drafted_tokens / 3 <= verify_steps <= finished.completion_tokens - 1  # k = 3 drafts at most
    by_position = [
        [sample(samples, f"specdec_position_{kind}_tokens_total", position=str(p)) for p in range(3)]
        for kind in ("drafted", "accepted")
    ]
    assert by_position[0][0] == verify_steps  # every verify step drafts position 0
    assert (sum(by_position[0]), sum(by_position[1])) == (finished.drafted_tokens, finished.accepted_tokens)
    assert [a <= d for d, a in zip(*by_position, strict=True)] == [True] * 3
    assert by_position[1] == [finished.accepted_tokens, 0, 0] and finished.accepted_tokens > 0
    mean = sample(samples, "specdec_mean_acceptance_length")
    assert mean == pytest.approx(1 + finished.accepted_tokens / verify_steps)
    assert mean == pytest.approx(finished.mean_acceptance_length)
    assert finished.verify_steps == verify_steps  # the request's own count, as the metrics counted it
    assert sample(samples, "specdec_generated_tokens_total") == finished.completion_tokens == 16

"""What the prefill graphs' tests check on the CPU (the stand-in graphs: the same static buffers and padding) and on
CUDA (real graphs): a lone request's prompt replayed through a bucket gives the eager forward's logits and
features and writes no cache slot but its own rows', and generations through them are the target's own tokens."""

from __future__ import annotations

import random

import torch
from greedy_reference import greedy_reference

from executor_service.engine.engine import Engine
from executor_service.engine.kv_cache import KVCache
from executor_service.engine.request import Request, RequestOutput
from executor_service.engine.scheduler import Scheduler
from executor_service.models.config import ModelConfig
from executor_service.models.loader import LoadedModel, build_synthetic
from executor_service.runner.model_runner import ModelRunner, StepInputs
from executor_service.sample.sampling import SamplingSettings

BLOCK_SIZE = 16
SENTINEL = 7.0  # what every cache slot holds before a prefill: a slot that still holds it was not written


def prefill_engine(
    config: ModelConfig, device: torch.device, backend: str, dtype: torch.dtype, max_rows: int, max_batched: int = 64,
    batched: bool = False, blocks: int = 64,
) -> tuple[LoadedModel, Engine]:  # fmt: skip
    """A target-only engine (up to 8 requests, a cache of `blocks` blocks) whose runner reads two layers' features
    (as for an EAGLE-3 drafter) and has prefill graphs for up to `max_rows` rows (`batched`: several requests' too),
    no other graph."""
    loaded = build_synthetic(config, 0, dtype, device)
    cache = KVCache(config, blocks, BLOCK_SIZE, dtype, device)
    runner = ModelRunner(loaded.model, cache, backend, device, feature_layers=(0, config.num_layers - 1))
    runner.capture_prefill_graphs(max_rows, config.max_position_embeddings)
    if batched:
        runner.capture_batch_prefill_graphs(max_rows, 8, config.max_position_embeddings)
    scheduler = Scheduler(cache.allocator, BLOCK_SIZE, max_batched, 8)
    return loaded, Engine(runner, scheduler, config.max_position_embeddings, overlap_decode=False)


def check_lone_prefill(engine: Engine, prompt: list[int], atol: float) -> int:
    """Schedule `prompt`'s prefill and check its replay (`check_replay`) through its lone bucket. Returns it."""
    engine.add(Request("lone", prompt, SamplingSettings(), 1, frozenset(), lambda _: None))
    inputs = scheduled_inputs(engine, 1)
    assert engine.runner.prefill_graphs is not None
    rows = engine.runner.prefill_graphs.bucket(inputs.attention, len(prompt))
    assert rows is not None and rows >= len(prompt)
    check_replay(engine, inputs, "prefill graph", atol)
    engine._abort(["lone"])
    return rows


def check_batch_prefill(engine: Engine, prompts: list[list[int]], atol: float) -> int:
    """Schedule the prompts' prefills in one step and check its replay (`check_replay`) through its batch graph.
    Returns the rows bucket."""
    for index, prompt in enumerate(prompts):
        engine.add(Request(f"b{index}", prompt, SamplingSettings(), 1, frozenset(), lambda _: None))
    inputs = scheduled_inputs(engine, len(prompts))
    assert engine.runner.batch_prefill_graphs is not None
    rows = engine.runner.batch_prefill_graphs.bucket(inputs.attention, inputs.input_ids.shape[0])
    assert rows is not None and rows >= sum(map(len, prompts))
    check_replay(engine, inputs, "batch prefill graph", atol)
    engine._abort([f"b{index}" for index in range(len(prompts))])
    return rows


def scheduled_inputs(engine: Engine, num_requests: int) -> StepInputs:
    """The next step's inputs, which must hold every one of the `num_requests` requests just added."""
    engine._drain_commands()
    scheduled = engine.scheduler.schedule()
    assert len(scheduled.requests) == num_requests
    return engine.runner.prepare(scheduled)


def check_replay(engine: Engine, inputs: StepInputs, counter: str, atol: float) -> None:
    """The step run eagerly, then by `execute` through a graph (its step count `counter`) over the same cache: equal
    logits and features, and the cache unchanged by the replay (its rows' K/V rewritten with the same values,
    nothing else written)."""
    runner = engine.runner
    runner.kv_cache.storage.fill_(SENTINEL)
    logits, features = runner.forward(inputs.input_ids, inputs.positions, inputs.attention, inputs.logits_indices)
    assert features is not None
    written = runner.kv_cache.storage.clone()
    before = runner.step_counts[counter]
    output = runner.execute(inputs)
    assert runner.step_counts[counter] == before + 1
    assert output.logits.shape == logits.shape and output.features is not None
    torch.testing.assert_close(output.logits, logits, atol=atol, rtol=0)
    torch.testing.assert_close(output.features, features, atol=atol, rtol=0)
    torch.testing.assert_close(runner.kv_cache.storage, written, atol=atol, rtol=0)
    assert (written != SENTINEL).any()  # the eager pass wrote its rows: the comparison above can see a write


def generate_one_by_one(
    loaded: LoadedModel, engine: Engine, lengths: list[int], max_tokens: int, seed: int = 0
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each prompt generated alone (batch 1, as a lone caller's), then all together: (outputs, greedy references)."""
    rng = random.Random(seed)
    prompts = {f"p{i}": [rng.randrange(loaded.config.vocab_size) for _ in range(n)] for i, n in enumerate(lengths)}
    outputs: dict[str, list[int]] = {}

    def sink(output: RequestOutput) -> None:
        assert output.error is None, output.error
        outputs.setdefault(output.request_id, []).extend(output.token_ids)

    for rid, prompt in prompts.items():
        engine.add(Request(rid, prompt, SamplingSettings(), max_tokens, frozenset(), sink))
        engine.run_until_idle()
    for rid, prompt in prompts.items():  # a batch of prefills: eager
        engine.add(Request(f"{rid}-batched", prompt, SamplingSettings(), max_tokens, frozenset(), sink))
    engine.run_until_idle()
    references = {rid: greedy_reference(loaded.model, prompt, max_tokens) for rid, prompt in prompts.items()}
    return outputs, references

"""The eager passes' warm-up at load (runner/eager_warm_up.py): its shapes meet every kernel class an eager pass of
any batch, row count and context can meet (the classes as the launches choose them, on a 132-SM GPU's figures), and
running it changes no cache. Negative control: with the split count that followed the longest context (before
2026-11-29), the classes are unbounded and the warm-up misses some."""

from __future__ import annotations

import random

import pytest
import torch
from spec_builders import spec_session

from executor_service.runner.eager_warm_up import Geometry, WarmUpShape, launch_classes, warm_up_models, warm_up_shapes
from kernels import triton_attn_config
from kernels.triton_attn_config import MAX_SPLITS, MIN_FILL, MIN_SPLIT_LEN

GPU = torch.device("cuda", 0)  # only its figures are read: the SMs and shared memory patched below
GEOMETRIES = [
    Geometry(3, 3, 64, 2),  # SmolLM2-135M, bf16
    Geometry(8, 4, 128, 2),  # Llama-3-8B
    Geometry(4, 4, 128, 2),  # Llama-3-8B at tensor parallelism 2
    Geometry(1, 8, 128, 4),  # fp32, one KV head
    Geometry(32, 1, 256, 2),  # no GQA, head 256
]


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_attn_config, "_num_sms", lambda index: 132)
    monkeypatch.setattr(
        triton_attn_config, "_device_shared_memory", lambda index: triton_attn_config.H100_SHARED_MEMORY
    )


def misses(geometry: Geometry, max_model_len: int, max_batch: int, trials: int = 3000) -> list[WarmUpShape]:
    """Random eager passes (decode-like, drafter-flush-like, prompt chunks) whose classes no warm-up shape met."""
    warmed = [launch_classes(s, geometry, GPU) for s in warm_up_shapes(geometry, max_model_len, max_batch, GPU)]
    configs, buckets = {c for c, _ in warmed}, {b for _, b in warmed}
    rng, missed = random.Random(11), []
    for _ in range(trials):
        query_len = min(max_model_len, rng.choice([1, rng.randint(2, 24), rng.randint(1, 2048)]))
        shape = WarmUpShape(rng.randint(1, max_batch), query_len, rng.randint(0, max_model_len - query_len))
        config, bucket = launch_classes(shape, geometry, GPU)
        if config not in configs or bucket not in buckets:
            missed.append(shape)
    return missed


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_the_warm_up_meets_every_class_an_eager_pass_meets(h100: None, geometry: Geometry) -> None:
    assert misses(geometry, 8192, 256) == []
    shapes = warm_up_shapes(geometry, 8192, 256, GPU)
    assert len(shapes) <= 20  # about a second each on a first start
    splits = {launch_classes(s, geometry, GPU)[0].num_splits for s in shapes}
    assert splits == ({1, MAX_SPLITS} if geometry.num_kv_heads * MIN_FILL <= 132 else {1})


def test_a_short_model_skips_shapes_past_its_length(h100: None) -> None:
    """A model of 64 positions: no shape longer, and every pass it can run is still met."""
    geometry = GEOMETRIES[0]
    shapes = warm_up_shapes(geometry, 64, 8, GPU)
    assert shapes and all(s.context + s.query_len <= 64 for s in shapes)
    assert misses(geometry, 64, 8) == []


def test_negative_control_splits_following_the_context_are_missed(h100: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def split_count(programs: int, num_sms: int, max_seq_len: int) -> tuple[int, int]:
        fill = num_sms // max(1, programs)
        needed = min(MAX_SPLITS, -(-max_seq_len // MIN_SPLIT_LEN))
        splits = 1 << (needed - 1).bit_length()
        return (1, 1) if fill < MIN_FILL or splits == 1 else (splits, min(splits, 1 << (fill.bit_length() - 1)))

    monkeypatch.setattr(triton_attn_config, "split_count", split_count)
    assert misses(GEOMETRIES[0], 8192, 256)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_warm_up_runs_each_model_and_writes_no_cache(method: str) -> None:
    session = spec_session(method, 3)
    engine, proposer = session.engine, session.proposer
    assert proposer is not None
    before = engine.runner.kv_cache.storage.clone(), proposer.kv_cache.storage.clone()
    max_model_len = session.limits.max_model_len
    runs = warm_up_models(engine.runner, proposer, max_model_len, 16)
    target = Geometry.of(engine.runner.model.config, engine.runner.kv_cache.layers[0][0])
    drafter = Geometry.of(proposer.config.model, proposer.kv_cache.layers[0][0])
    cpu = torch.device("cpu")
    assert runs == len(warm_up_shapes(target, max_model_len, 16, cpu)) + len(
        warm_up_shapes(drafter, max_model_len, 16, cpu)
    )
    assert torch.equal(engine.runner.kv_cache.storage, before[0])
    assert torch.equal(proposer.kv_cache.storage, before[1])


def test_a_model_on_flex_attention_is_not_warmed() -> None:
    """Flex compiles once per set of shapes (dynamo): the warm-up leaves it alone, and a TRITON_ATTN drafter beside a
    flex target is still warmed (the control: the count is not zero for want of passes)."""
    session = spec_session("eagle3", 3, "FLEX_ATTENTION")
    assert session.proposer is not None
    engine, max_model_len = session.engine, session.limits.max_model_len
    assert warm_up_models(engine.runner, session.proposer, max_model_len, 16) == 0
    session.proposer.backend = "CPU_ATTN"
    assert warm_up_models(engine.runner, session.proposer, max_model_len, 16) > 0

"""Prefill graphs on CUDA (runner/prefill_graphs.py): a lone request's prompt, and several requests' rows, replayed
through their buckets give the eager forward's logits and features and write no cache slot but their own rows' (fp32
tightly, bf16 within rounding), greedy generations through the buckets equal the dense reference (fp32), and the
memory estimate covers what their capture keeps. The buckets' short rows take the split-key attention path, captured
for the model's whole length (2,048 positions)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from executor_builders import gpu_test_config
from kernel_counting import smollm2
from prefill_graph_cases import check_batch_prefill, check_lone_prefill, generate_one_by_one, prefill_engine

from executor_service.engine.kv_cache import KVCache
from executor_service.models.loader import build_synthetic
from executor_service.runner.model_runner import ModelRunner
from executor_service.server import memory
from kernels import unavailable_reason

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
CONFIG = gpu_test_config()


def backend_or_skip(backend: str) -> str:
    reason = unavailable_reason(backend, CUDA)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    return backend


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("length", [3, 16, 50, 200, 1000])
def test_a_lone_prefill_through_its_bucket_is_the_eager_one(dtype: torch.dtype, atol: float, length: int) -> None:
    _, engine = prefill_engine(CONFIG, CUDA, backend_or_skip("TRITON_ATTN"), dtype, max_rows=1024, max_batched=1024)
    prompt = [(7 * i + 3) % CONFIG.vocab_size for i in range(length)]
    check_lone_prefill(engine, prompt, atol=atol)


def test_generations_through_prefill_graphs_equal_the_dense_reference() -> None:
    loaded, engine = prefill_engine(CONFIG, CUDA, backend_or_skip("TRITON_ATTN"), torch.float32, 256, max_batched=96)
    outputs, references = generate_one_by_one(loaded, engine, [1, 9, 33, 64, 250], max_tokens=8)
    for rid, reference in references.items():
        assert outputs[rid] == reference, rid
        assert outputs[f"{rid}-batched"] == reference, rid
    assert engine.runner.step_counts["prefill graph"] >= 6, engine.runner.step_counts


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("lengths", [[1, 1], [3, 50, 7], [200, 1, 300], [16] * 8])
def test_several_prefills_through_their_batch_bucket_are_the_eager_ones(
    dtype: torch.dtype, atol: float, lengths: list[int]
) -> None:
    _, engine = prefill_engine(
        CONFIG, CUDA, backend_or_skip("TRITON_ATTN"), dtype, max_rows=1024, max_batched=1024, batched=True
    )
    prompts = [[(7 * i + 3 * j) % CONFIG.vocab_size for i in range(n)] for j, n in enumerate(lengths)]
    check_batch_prefill(engine, prompts, atol=atol)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_prefills_past_1024_rows_through_their_buckets(dtype: torch.dtype, atol: float) -> None:
    """A small model's buckets past 1,024 rows (prefill_graph_rows): a lone 1,500-token prompt and two of 700 and
    900 in one step replay the 2,048-row graphs with the eager pass's logits, features and cache."""
    _, engine = prefill_engine(
        CONFIG, CUDA, backend_or_skip("TRITON_ATTN"), dtype, 2048, max_batched=2048, batched=True, blocks=256
    )
    prompts = [[(7 * i + 3 * n) % CONFIG.vocab_size for i in range(n)] for n in (1500, 700, 900)]
    assert check_lone_prefill(engine, prompts[0], atol=atol) == 2048
    assert check_batch_prefill(engine, prompts[1:], atol=atol) == 2048


def test_generations_through_batch_prefill_graphs_equal_the_dense_reference() -> None:
    loaded, engine = prefill_engine(
        CONFIG, CUDA, backend_or_skip("TRITON_ATTN"), torch.float32, 256, max_batched=96, batched=True
    )
    outputs, references = generate_one_by_one(loaded, engine, [1, 9, 33, 64, 250], max_tokens=8)
    for rid, reference in references.items():
        assert outputs[f"{rid}-batched"] == reference, rid
    assert engine.runner.step_counts["batch prefill graph"] >= 4, engine.runner.step_counts


def test_the_memory_estimate_covers_the_prefill_graphs_pool() -> None:
    """SmolLM2-135M's shape in bf16 with two feature layers: what capturing the buckets up to 1,024 rows keeps
    reserved (their pool and static inputs, after the warm-ups' cached memory is released) is within what
    estimate_memory counts for them."""
    config = smollm2(30)
    backend = backend_or_skip("TRITON_ATTN")
    loaded = build_synthetic(config, 0, torch.bfloat16, CUDA)
    cache = KVCache(config, 64, 16, torch.bfloat16, CUDA)
    runner = ModelRunner(loaded.model, cache, backend, CUDA, feature_layers=(0, config.num_layers - 1))
    gc.collect()  # earlier tests' graphs freed now, not by the capture's own collection (their pools would count)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(CUDA)
    runner.capture_prefill_graphs(1024, config.max_position_embeddings)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved(CUDA) - before
    draft = SimpleNamespace(target_layer_ids=(0, config.num_layers - 1))  # what the estimate reads of a drafter
    estimate = memory.prefill_graph_bytes(config, draft, 1024, 2)  # type: ignore[arg-type]
    print(f"prefill graphs kept {kept / 2**20:.1f} MiB, estimated {estimate / 2**20:.1f} MiB")
    assert 0 < kept <= estimate
    runner.capture_batch_prefill_graphs(1024, 32, config.max_position_embeddings)  # into the same pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept_batch = torch.cuda.memory_reserved(CUDA) - before - kept
    estimate_batch = memory.batch_prefill_graph_bytes(config, draft, 1024, 32, 2)  # type: ignore[arg-type]
    print(f"batch prefill graphs kept {kept_batch / 2**20:.1f} MiB, estimated {estimate_batch / 2**20:.1f} MiB")
    assert 0 < kept_batch <= estimate_batch

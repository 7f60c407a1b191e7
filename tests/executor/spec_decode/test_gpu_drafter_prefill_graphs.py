"""The drafter's lone-request context-pass graphs on CUDA (Proposer.capture_prefill_graphs, captured at load): every
context pass that replays a bucket gives the eager pass's outputs and cache writes (fp32 tightly, bf16 within
rounding), for chains and trees, generations through them equal the target's own greedy tokens (fp32), and the memory
estimate covers the pool that the shipped drafters' shapes keep."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from drafter_prefill_cases import checked_session, generate, generate_together
from greedy_reference import greedy_reference
from kernel_counting import smollm2
from tree_cases import TREES

from executor_service.engine.kv_cache import KVCache
from executor_service.models.loader import build_synthetic
from executor_service.server import memory
from executor_service.server.drafting import build_drafter, resolve_draft
from executor_service.server.session import proposer_class
from kernels import unavailable_reason
from specdec.v1 import common_pb2, executor_pb2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if unavailable_reason("TRITON_ATTN", torch.device("cuda")) is not None:
    pytest.skip("TRITON_ATTN is unavailable here", allow_module_level=True)

CUDA = torch.device("cuda")
DRAFTERS = Path(__file__).resolve().parents[3] / "drafters"


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize(("dtype", "atol"), [(common_pb2.DTYPE_FLOAT32, 1e-4), (common_pb2.DTYPE_BFLOAT16, 0.1)])
def test_lone_context_passes_through_their_buckets_are_the_eager_ones(method: str, dtype: int, atol: float) -> None:
    session, buckets = checked_session(method, max_rows=256, device="cuda", dtype=dtype, atol=atol)
    for length in (3, 50, 200):
        prompt = [(7 * i + 3) % 500 for i in range(length)]
        tokens = generate(session, prompt, 8)
        if dtype == common_pb2.DTYPE_FLOAT32:
            assert tokens == greedy_reference(session.loaded.model, prompt, 8), length
    assert buckets[:1] == [16] and 64 in buckets and 256 in buckets, buckets


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize(("dtype", "atol"), [(common_pb2.DTYPE_FLOAT32, 1e-4), (common_pb2.DTYPE_BFLOAT16, 0.1)])
def test_several_requests_context_passes_through_the_batch_buckets(method: str, dtype: int, atol: float) -> None:
    """Three prompts prefilled together: the drafter's context pass over their rows replays a batch bucket the load
    captured, with the eager pass's outputs and cache writes; fp32 tokens the target's own."""
    session, buckets = checked_session(method, max_rows=256, device="cuda", dtype=dtype, atol=atol, batched=True)
    prompts = {f"r{i}": [(11 * i + 5 * j) % 500 for j in range(n)] for i, n in enumerate((9, 120, 40))}
    outputs = generate_together(session, prompts, 8)
    if dtype == common_pb2.DTYPE_FLOAT32:
        for rid, prompt in prompts.items():
            assert outputs[rid] == greedy_reference(session.loaded.model, prompt, 8), rid
    counts = session.proposer.pass_counts if session.proposer is not None else {}
    name = f"{method.removesuffix('3')}_context"
    assert buckets[0] == 256 and counts[f"{name} batch prefill graph"] >= 1, (buckets, counts)


@pytest.mark.parametrize(("method", "shape"), [("eagle3", "dynamic_3_budget_8_depth_4"), ("dflash", "static_3_2")])
def test_a_trees_lone_context_passes_through_their_buckets_are_the_eager_ones(method: str, shape: str) -> None:
    """A tree drafter's prompt proposals (the host path's): through the buckets the load captured, fp32."""
    session, buckets = checked_session(method, max_rows=256, device="cuda", atol=1e-4, tree=TREES[shape])
    for length in (3, 50, 200):
        prompt = [(5 * i + 2) % 500 for i in range(length)]
        assert generate(session, prompt, 8) == greedy_reference(session.loaded.model, prompt, 8), length
    assert buckets[:1] == [16] and 64 in buckets and 256 in buckets, buckets


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_memory_estimate_covers_the_drafters_prefill_graphs_pool(method: str) -> None:
    """The shipped SmolLM2 drafter's shape in bf16 over a SmolLM2-shaped target: what capturing its context pass's
    buckets up to 1,024 rows keeps reserved is within what estimate_memory counts for them."""
    target_config = smollm2(30)
    method_enum = common_pb2.SPEC_METHOD_EAGLE3 if method == "eagle3" else common_pb2.SPEC_METHOD_DFLASH
    draft = executor_pb2.DraftModel(method=method_enum, num_speculative_tokens=3)
    draft.source.path = f"smollm2-{method}"
    source = resolve_draft(draft, target_config, DRAFTERS)
    target = build_synthetic(target_config, 0, torch.bfloat16, CUDA)
    drafter = build_drafter(source, target.model, torch.bfloat16, CUDA)
    cache = KVCache(source.config.model, 64, 16, torch.bfloat16, CUDA)
    proposer = proposer_class(source.config)(drafter, cache, "TRITON_ATTN", 2048, CUDA)
    gc.collect()  # earlier tests' graphs freed now, not by the capture's own collection (their pools would count)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(CUDA)
    proposer.capture_prefill_graphs(1024)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved(CUDA) - before
    estimate = memory.draft_prefill_graph_bytes(target_config, source.config, 1024, 2)
    print(f"{method} drafter prefill graphs kept {kept / 2**20:.1f} MiB, estimated {estimate / 2**20:.1f} MiB")
    assert 0 < kept <= estimate

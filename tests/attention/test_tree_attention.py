"""Tree attention (tree drafting's verify and draft passes) against a dense reference written independently:
SDPA with an explicit boolean mask built by walking each draft's parents, not from the kernels' bitmasks.

Batches mix tree requests (random trees, contexts shorter and longer than the 64-key window) with plain causal
requests (mask -1), on every backend that claims tree attention. The trees are not chains, so a kernel that
treated the mask as causal would fail: `test_a_causal_kernel_fails_the_reference` shows the check catches it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from flex_emulation import emulate_sparse_kernel

from kernels import paged_attention, unavailable_reason
from kernels.attention import AttentionBatch
from kernels.capabilities import BACKENDS, TREE_ATTENTION_NOT_SUPPORTED, AttentionNeeds, DType, Hardware, Platform
from kernels.flex_attn import build_flex_metadata
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch
from kernels.tree_mask import CAUSAL, TREE_WINDOW, tree_masks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TREE_BACKENDS = ["CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"]


def random_tree(size: int, rng: random.Random) -> list[int]:
    """Parents of `size` query tokens in topological order: token 0 is the root (the last verified token),
    every other token hangs below an earlier one; at least two tokens share a parent (not a chain)."""
    parents = [-1] + [rng.randrange(j) for j in range(1, size)]
    if size > 2:
        parents[2] = parents[1]  # siblings: a causal mask would let token 2 see token 1
    return parents


def tree_case(seed: int) -> tuple[BatchSpec, list[list[int] | None]]:
    """A batch of tree requests (contexts below and above the window) and causal ones (None)."""
    rng = random.Random(seed)
    trees: list[list[int] | None] = [
        random_tree(16, rng),
        None,
        random_tree(TREE_WINDOW, rng),
        random_tree(5, rng),
        None,
        random_tree(1, rng),
    ]
    contexts = [3, 20, 90, 130, 0, 40]
    query_lens = [len(t) if t is not None else n for t, n in zip(trees, [1, 7, 1, 1, 24, 1], strict=True)]
    spec = BatchSpec(f"tree{seed}", tuple(c + q for c, q in zip(contexts, query_lens, strict=True)), tuple(query_lens))
    return spec, trees


def masks_tensor(trees: list[list[int] | None], spec: BatchSpec, device: torch.device) -> torch.Tensor:
    values: list[int] = []
    for tree, query_len in zip(trees, spec.query_lens, strict=True):
        values += tree_masks(tree) if tree is not None else [CAUSAL] * query_len
    return torch.tensor(values, dtype=torch.int64, device=device)


def dense_reference(batch: PagedBatch, trees: list[list[int] | None], scale: float) -> torch.Tensor:
    """Float64 SDPA per request with a boolean mask: the context, then each draft's chain of parents."""
    q = batch.q.double().cpu()
    group = q.shape[1] // batch.keys[0].shape[1]
    out, start = torch.empty_like(q), 0
    for keys, values, tree, query_len in zip(batch.keys, batch.values, trees, batch.spec.query_lens, strict=True):
        seq_len = keys.shape[0]
        context = seq_len - query_len
        mask = torch.zeros(query_len, seq_len, dtype=torch.bool)
        mask[:, :context] = True
        for i in range(query_len):
            if tree is None:
                mask[i, context : context + i + 1] = True
                continue
            node = i
            while node >= 0:  # itself and every ancestor
                mask[i, context + node] = True
                node = tree[node]
        result = F.scaled_dot_product_attention(
            q[start : start + query_len].transpose(0, 1),
            keys.double().repeat_interleave(group, 1).transpose(0, 1),
            values.double().repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[start : start + query_len] = result.transpose(0, 1)
        start += query_len
    return out


def _batch(seed: int, block_size: int = 16, dtype: torch.dtype = torch.float32):
    spec, trees = tree_case(seed)
    batch = make_paged_batch(spec, 4, 2, 32, block_size, dtype, DEVICE, seed=seed)
    return batch, trees, masks_tensor(trees, spec, DEVICE)


def _run(backend: str, batch: PagedBatch, tree_mask: torch.Tensor | None) -> torch.Tensor:
    return paged_attention(
        backend, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        True, tree_mask=tree_mask,
    )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", TREE_BACKENDS)
def test_tree_mask_matches_the_dense_reference(backend: str, seed: int) -> None:
    if unavailable_reason(backend, DEVICE) is not None:
        pytest.skip(unavailable_reason(backend, DEVICE))
    batch, trees, masks = _batch(seed)
    out = _run(backend, batch, masks)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, trees, 32**-0.5), atol=2e-4, rtol=2e-4)


def test_a_causal_kernel_fails_the_reference() -> None:
    """The trees differ from chains where it shows: the causal output misses the reference."""
    batch, trees, _ = _batch(0)
    causal = _run("CPU_ATTN", batch, None).double().cpu()
    reference = dense_reference(batch, trees, 32**-0.5)
    assert not torch.allclose(causal, reference, atol=1e-2, rtol=1e-2)
    tree_rows = torch.tensor([m != CAUSAL for m in masks_tensor(trees, batch.spec, DEVICE).tolist()])
    torch.testing.assert_close(causal[~tree_rows], reference[~tree_rows], atol=2e-4, rtol=2e-4)  # causal: the same


@pytest.mark.skipif(unavailable_reason("TRITON_ATTN", DEVICE) is not None, reason="triton unavailable")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_tree_mask_split_kv(num_splits: int) -> None:
    """The split-KV path (few queries over long contexts) and tiles smaller than the window."""
    from kernels import triton_attn
    from kernels.triton_attn import LaunchConfig

    batch, trees, masks = _batch(2, block_size=32)
    meta = AttentionBatch(
        batch.block_table, batch.query_start_loc, batch.seq_lens, True, 32**-0.5, TREE_WINDOW, max(batch.spec.seq_lens),
        tree_mask=masks,
    )  # fmt: skip
    config = LaunchConfig(block_m=128, block_n=16, num_splits=num_splits, num_warps=4, num_stages=2, min_split_len=16)
    out = triton_attn.forward(batch.q, batch.k_cache, batch.v_cache, meta, None, config)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, trees, 32**-0.5), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("block_size", [16, 64])
def test_flex_block_lists_with_trees(block_size: int) -> None:
    """What the compiled kernel reads (listed blocks only, mask_mod on partial blocks only) still gives the tree
    attention: no block holding a tree token's window keys may be listed as full."""
    batch, trees, masks = _batch(3, block_size=block_size)
    meta = build_flex_metadata(
        batch.block_table, batch.query_start_loc, batch.seq_lens, True, batch.k_cache.shape[0], block_size,
        batch.q.shape[0], tree_mask=masks,
    )  # fmt: skip
    result = emulate_sparse_kernel(batch, meta, 32**-0.5)
    torch.testing.assert_close(result, dense_reference(batch, trees, 32**-0.5), atol=1e-5, rtol=1e-5)


def test_backends_without_tree_attention_are_refused() -> None:
    needs = AttentionNeeds(head_size=128, dtype=DType.BFLOAT16, block_size=16, use_tree_attention=True)
    h100 = Hardware(Platform.CUDA, (9, 0), libraries=(("flash_attn", "2.8.3"), ("triton", "3.6.0"), ("torch", "2.11")))
    assert TREE_ATTENTION_NOT_SUPPORTED in BACKENDS["FLASH_ATTN"].validate(needs, h100)
    assert BACKENDS["TRITON_ATTN"].validate(needs, h100) == []
    assert BACKENDS["FLEX_ATTENTION"].validate(needs, h100) == []
    claim = {name for name, cap in BACKENDS.items() if cap.supports_tree_attention}
    assert claim == set(TREE_BACKENDS)
    batch, _, masks = _batch(0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=TREE_ATTENTION_NOT_SUPPORTED):
        _run("FLASH_ATTN", batch, masks)


def test_tree_masks_are_checked() -> None:
    batch, _, masks = _batch(0)
    with pytest.raises(ValueError, match="causal"):
        paged_attention(
            "CPU_ATTN", batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, False, tree_mask=masks,
        )  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        _run("CPU_ATTN", batch, masks[:-1])
    with pytest.raises(ValueError, match="topological"):
        tree_masks([-1, 2, 0])
    with pytest.raises(ValueError, match="window"):
        tree_masks([-1] * (TREE_WINDOW + 1))


@pytest.mark.skipif(not os.environ.get("SPECDEC_COMPILE_TESTS"), reason="set SPECDEC_COMPILE_TESTS=1 (compiles, ~10 s)")
def test_compiled_flex_tree_mask_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU code path (compiled flex, listed blocks only, the tree mask_mod compiled) through inductor's CPU
    kernel."""
    from kernels import flex_attn

    monkeypatch.setattr(flex_attn, "_runs_compiled", lambda device: True)
    batch, trees, masks = _batch(0)
    out = _run("FLEX_ATTENTION", batch, masks)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, trees, 32**-0.5), atol=2e-4, rtol=2e-4)

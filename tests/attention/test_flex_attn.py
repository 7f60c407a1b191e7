"""FLEX_ATTENTION's metadata, checked where the CPU (eager) path cannot: eager flex ignores the block lists, so a
block wrongly left out or a mask-free "full" block wrongly listed would show only on the GPU. Here the lists are
checked against an independent visibility mask, and a block-sparse emulation of the GPU kernel runs over them.
"""

from __future__ import annotations

import os

import pytest
import torch
from flex_emulation import _blocks, emulate_sparse_kernel

from kernels import flex_attn, paged_attention
from kernels.flex_attn import Q_BLOCK, FlexMetadata, build_flex_metadata, forward_with_metadata, unavailable_reason
from kernels.testing import BATCH_SPECS, BatchSpec, PagedBatch, make_paged_batch, reference_attention

SPECS = [
    *(s for s in BATCH_SPECS.values() if not s.name.startswith("large")),
    BatchSpec("with_empty", (20, 33, 17, 5), (3, 0, 2, 0)),
    BatchSpec("none", (), ()),
]


def _metadata(batch: PagedBatch, causal: bool) -> FlexMetadata:
    return build_flex_metadata(
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        causal,
        batch.k_cache.shape[0],
        batch.k_cache.shape[1],
        batch.q.shape[0],
    )


def _visible(batch: PagedBatch, causal: bool, padded: int) -> torch.Tensor:
    """[padded tokens, cache slots]: which slot each query token sees, straight from the spec."""
    block_size = batch.k_cache.shape[1]
    visible = torch.zeros(padded, batch.k_cache.shape[0] * block_size, dtype=torch.bool)
    token = 0
    for b, (seq_len, query_len) in enumerate(zip(batch.spec.seq_lens, batch.spec.query_lens, strict=True)):
        positions = torch.arange(seq_len)
        slots = batch.block_table[b, positions // block_size].long() * block_size + positions % block_size
        for i in range(query_len):
            limit = seq_len - query_len + i if causal else seq_len - 1
            visible[token + i, slots[positions <= limit]] = True
        token += query_len
    return visible


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_block_lists_cover_exactly_the_visible_keys(spec: BatchSpec, causal: bool, block_size: int) -> None:
    batch = make_paged_batch(spec, 1, 1, 16, block_size, torch.float32, "cpu")
    meta = _metadata(batch, causal)
    mask = meta.block_mask
    visible = _visible(batch, causal, meta.padded_tokens)
    tokens, slots = torch.arange(meta.padded_tokens)[:, None], torch.arange(visible.shape[1])[None, :]
    assert torch.equal(mask.mask_mod(0, 0, tokens, slots), visible)
    poison = batch.k_cache.shape[0] - 1
    partial = _blocks(mask.kv_num_blocks, mask.kv_indices)
    full = _blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
    tiles = visible.view(-1, Q_BLOCK, batch.k_cache.shape[0], block_size)
    for tile, (part, whole) in enumerate(zip(partial, full, strict=True)):
        needed = set(tiles[tile].any(-1).any(0).nonzero().flatten().tolist())
        assert not part & whole and poison not in part | whole
        assert needed <= part | whole, f"tile {tile} misses blocks {needed - part - whole}"
        assert part | whole <= needed, f"tile {tile} visits unneeded blocks {(part | whole) - needed}"
        assert all(tiles[tile, :, block].all() for block in whole), f"tile {tile}: a full block needs a mask"


@pytest.mark.parametrize("spec", ["mixed_small", "dflash_small", "full_prefill", "mixed_medium"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_block_sparse_emulation_matches_reference(spec: str, causal: bool, block_size: int) -> None:
    batch = make_paged_batch(BATCH_SPECS[spec], 4, 2, 32, block_size, torch.float32, "cpu", seed=5)
    meta = _metadata(batch, causal)
    result = emulate_sparse_kernel(batch, meta, 32**-0.5)
    assert not result.isnan().any()
    torch.testing.assert_close(result, reference_attention(batch, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not os.environ.get("SPECDEC_COMPILE_TESTS"), reason="set SPECDEC_COMPILE_TESTS=1 (compiles, ~30 s)")
@pytest.mark.parametrize(("spec", "causal", "block_size"), [("full_prefill", True, 16), ("dflash_small", False, 128)])
def test_compiled_path_on_cpu(monkeypatch: pytest.MonkeyPatch, spec: str, causal: bool, block_size: int) -> None:
    """The GPU code path (compiled flex, no value zeroing) through inductor's CPU kernel, which like the Triton one
    reads only the listed blocks: were the NaN block listed, the output would be NaN."""
    monkeypatch.setattr(flex_attn, "_runs_compiled", lambda device: True)
    batch = make_paged_batch(BATCH_SPECS[spec], 8, 2, 64, block_size, torch.float32, "cpu", seed=2)
    assert _metadata(batch, causal).used_slots is None
    out = paged_attention(
        "FLEX_ATTENTION", batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, causal,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), reference_attention(batch, causal), atol=2e-4, rtol=2e-4)


def test_full_blocks_are_used() -> None:
    batch = make_paged_batch(BATCH_SPECS["full_prefill"], 1, 1, 16, 16, torch.float32, "cpu")
    assert int(_metadata(batch, True).block_mask.full_kv_num_blocks.sum()) > 0


def test_metadata_reused_across_layers_and_strided_caches() -> None:
    """One metadata for several 'layers'; caches that are views of a stacked tensor or of another layout."""
    batch = make_paged_batch(BATCH_SPECS["mixed_small"], 8, 2, 64, 16, torch.float32, "cpu", seed=1)
    meta = _metadata(batch, True)
    expected = reference_attention(batch, True)
    stacked = torch.stack([batch.k_cache, batch.v_cache])  # [2, NB, BS, H, D]: views that flatten without a copy
    heads_major = batch.k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # forces a reshape copy
    for k_cache, v_cache in ((batch.k_cache, batch.v_cache), (stacked[0], stacked[1]), (heads_major, stacked[1])):
        out = forward_with_metadata(batch.q, k_cache, v_cache, meta, 64**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="metadata built for"):
        forward_with_metadata(batch.q[:-1], batch.k_cache, batch.v_cache, meta, 1.0)


def test_empty_batch() -> None:
    batch = make_paged_batch(BatchSpec("none", (), ()), 4, 2, 64, 16, torch.float32, "cpu")
    out = paged_attention(
        "FLEX_ATTENTION", batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, True,
    )  # fmt: skip
    assert out.shape == (0, 4, 64)


def test_unavailable_reason() -> None:
    assert unavailable_reason(torch.device("cpu")) is None
    assert "meta" in (unavailable_reason(torch.device("meta")) or "")


def test_partial_and_full_block_lists_share_one_layout() -> None:
    """On CUDA (torch 2.11) flex read the full-block lists with the partial lists' strides: lists of
    different widths produced wrong outputs and illegal memory accesses on an H100. Keep them equal."""
    from kernels.testing import BATCH_SPECS, make_paged_batch

    batch = make_paged_batch(BATCH_SPECS["dflash_small"], 4, 2, 64, 16, torch.float32, "cpu")
    for causal in (True, False):
        meta = flex_attn.build_flex_metadata(
            batch.block_table,
            batch.query_start_loc,
            batch.seq_lens,
            causal,
            batch.k_cache.shape[0],
            16,
            batch.q.shape[0],
        )
        mask = meta.block_mask
        assert mask.kv_indices.shape == mask.full_kv_indices.shape
        assert int(mask.full_kv_num_blocks.sum()) > 0  # the case that broke: tiles with full blocks

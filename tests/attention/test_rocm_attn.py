"""ROCM_ATTN paths the spec matrix may not reach: the key-length mask of the non-causal new-token part (the bug
vLLM's review of #40176 found), several query tiles per request, empty requests, strided caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import paged_attention, unavailable_reason
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = 2e-4 if DTYPE is torch.float32 else 1.6e-2

pytestmark = pytest.mark.skipif(unavailable_reason("ROCM_ATTN", DEVICE) is not None, reason="ROCM_ATTN unavailable")

# Every request's last key tile runs past seq_len, within its last block and into the padding blocks;
# contexts of 0, 5, 54 and 64 keys; 66 and 130 new tokens need several query tiles; one request has none.
TAIL_SPEC = BatchSpec("tails", (21, 70, 66, 130, 67, 40), (16, 16, 66, 130, 3, 0))


def _fill_unwritten(batch: PagedBatch, value: float) -> None:
    """Put `value` in every cache slot that holds none of the requests' keys (block tails, null, padding)."""
    block_size = batch.k_cache.shape[1]
    written = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, seq_len in enumerate(batch.spec.seq_lens):
        positions = torch.arange(seq_len, device=DEVICE)
        written[batch.block_table[b, positions // block_size].long(), positions % block_size] = True
    batch.k_cache[~written] = value
    batch.v_cache[~written] = value


def _check(
    batch: PagedBatch,
    causal: bool,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    tol: float = TOL,
) -> None:
    out = torch.full_like(batch.q, float("nan"))  # rows a tile forgets stay NaN
    paged_attention(
        "ROCM_ATTN",
        batch.q,
        batch.k_cache if k_cache is None else k_cache,
        batch.v_cache if v_cache is None else v_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        causal,
        out=out,
    )
    assert not torch.isnan(out).any(), "NaN in the output: a row was not written or a key past seq_len leaked in"
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, causal), atol=tol, rtol=tol)


@pytest.mark.parametrize("garbage", [float("nan"), 30.0], ids=["nan", "large"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_keys_past_seq_len_are_masked(block_size: int, causal: bool, garbage: float) -> None:
    """Keys at or past seq_len must neither load (NaN) nor score (a key loaded as 0 scores 0, not -inf, and
    inflates the softmax denominator: vLLM's first non-causal prefix-prefill had that bug)."""
    batch = make_paged_batch(TAIL_SPEC, 4, 1, 80, block_size, DTYPE, DEVICE, seed=11)
    _fill_unwritten(batch, garbage)
    _check(batch, causal)


@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 32)], ids=lambda t: f"m{t[0]}-n{t[1]}")
def test_small_tiles(monkeypatch: pytest.MonkeyPatch, tiles: tuple[int, int]) -> None:
    """Many query tiles per request and key tiles inside a block: the tile-to-request binary search."""
    from kernels import rocm_attn

    monkeypatch.setattr(rocm_attn, "BLOCK_M", tiles[0])
    monkeypatch.setattr(rocm_attn, "BLOCK_N", tiles[1])
    spec = BatchSpec("many_tiles", (40, 17, 90, 33, 50, 7), (1, 17, 45, 0, 33, 7))
    batch = make_paged_batch(spec, 4, 2, 64, 32, DTYPE, DEVICE, seed=5)
    _fill_unwritten(batch, float("nan"))
    for causal in (True, False):
        _check(batch, causal)


def test_strided_caches() -> None:
    """K and V as views of one [blocks, block_size, Hkv, 2D] cache (vLLM's layout), q a slice of qkv."""
    batch = make_paged_batch(BatchSpec("strided", (21, 67, 40), (16, 3, 40)), 4, 2, 96, 16, DTYPE, DEVICE, seed=3)
    head_size = batch.q.shape[-1]
    kv = torch.cat([batch.k_cache, batch.v_cache], dim=-1)
    qkv = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)
    strided = dataclasses.replace(batch, q=qkv[:, : batch.q.shape[1]])
    assert not strided.q.is_contiguous()
    for causal in (True, False):
        _check(strided, causal, kv[..., :head_size], kv[..., head_size:])


@pytest.mark.parametrize("head_size", [80, 256])
def test_every_dtype_and_wide_heads(head_size: int) -> None:
    """fp32 (exact dots, halved key tiles on wide heads: shared memory on GPUs) and the half types."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
    for dtype in dtypes:
        batch = make_paged_batch(BatchSpec("wide", (21, 67), (16, 3)), 4, 1, head_size, 16, dtype, DEVICE, seed=2)
        _fill_unwritten(batch, float("nan"))
        for causal in (True, False):
            _check(batch, causal, tol={torch.float32: 2e-4, torch.float16: 1e-2}.get(dtype, 1.6e-2))


def test_unavailable_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import rocm_attn

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in rocm_attn.unavailable_reason(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert rocm_attn.unavailable_reason(torch.device("cpu")) is None

"""ROCM_ATTN: a prefix-prefill style Triton kernel over the paged cache, context unmasked, new tokens causal or not.

Why it exists: vLLM's ROCM_ATTN backend runs multi-token queries through the prefix-prefill kernel
(`prefix_prefill._fwd_kernel`), and DFlash needs it non-causal (vLLM #40176). This is our own kernel with
that kernel's structure, so the backend behaves the same way on any Triton device:

  grid (query tiles of a request, query heads): a program takes BLOCK_M new tokens of one request, one head;
  (1) the cached context, key positions < context_len: no causal mask, only the context-length bound;
  (2) the new tokens, key positions context_len .. seq_len - 1: causal (q_pos >= k_pos) when CAUSAL,
      else every key below seq_len.

The bug vLLM's review found in the first non-causal version: keys of the last tile past the request's length
were not masked out of the scores, so the softmax denominator was wrong. Here every score is masked with
k_pos < seq_len (and loads past it read 0, so NaN in padding blocks never enters); tests/attention/
test_rocm_attn.py checks exactly that case.

Tiles map to requests with no host sync: the grid launches cdiv(T, BLOCK_M) + B tiles, request b owns the
tiles from query_start_loc[b] // BLOCK_M + b on, and a program finds its request by binary search.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionBatch
from kernels.triton_attn import LOG2E, find_request  # the tile -> request search both kernels use
from kernels.triton_attn_config import MIN_BLOCK, LaunchConfig, is_hip, shared_memory_bytes, shared_memory_limit

BLOCK_M = 64  # new tokens per program
BLOCK_N = 64  # keys per step
NUM_WARPS = 4


def unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda":  # CUDA and ROCm builds of torch both say cuda
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "triton on CPU needs TRITON_INTERPRET=1 (set before the kernel is built)"
    return f"no Triton backend for {device.type} devices"


def _block_n(block_d: int, itemsize: int, device: torch.device) -> int:
    """Keys per step whose K and V tiles (and fp32's P tile) fit the device's shared memory: in fp32 an
    MI300's 64 KiB LDS holds 64 keys of head 64 but only 32 of head 128 and 16 of head 256."""
    limit, hip = shared_memory_limit(device), is_hip(device)
    block_n = BLOCK_N
    while (
        block_n > MIN_BLOCK
        and shared_memory_bytes(LaunchConfig(BLOCK_M, block_n, 1, NUM_WARPS, 3), block_d, itemsize, hip) > limit
    ):
        block_n //= 2
    return block_n


def forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, out: torch.Tensor | None
) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_size = q.shape
    num_requests = batch.num_requests
    if num_tokens == 0 or num_requests == 0:
        return out
    block_d = max(16, 1 << (head_size - 1).bit_length())
    block_n = _block_n(block_d, q.element_size(), q.device)
    grid = (-(-num_tokens // BLOCK_M) + num_requests, num_heads)
    prefix_prefill_kernel[grid](
        q, k_cache, v_cache, out, batch.block_table, batch.query_start_loc, batch.seq_lens,
        batch.scale * LOG2E, num_requests, num_heads // k_cache.shape[2], head_size, k_cache.shape[1],
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), batch.block_table.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=batch.causal,
        PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_requests", "stride_table"])  # batch and table width vary per step
def prefix_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2e, num_requests, num_queries_per_kv, head_size, block_size,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, stride_table,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // num_queries_per_kv

    request = find_request(query_start_loc_ptr, tile, num_requests, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - q_start
    tile_start = (tile - (q_start // BLOCK_M + request)) * BLOCK_M
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len

    offs_m = tile_start + tl.arange(0, BLOCK_M)  # query index within the request
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < query_len
    d_mask = offs_d < head_size
    rows = (q_start + offs_m).to(tl.int64)
    q_offs = rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_ptr = block_table_ptr + request.to(tl.int64) * stride_table
    q_pos = context_len + offs_m

    # Phase 0, the cached context: every query sees all of it (bounded by context_len only).
    # Phase 1, the new tokens: causal up to the tile's last query, else all of them; masked at seq_len.
    for phase in tl.static_range(2):
        if phase == 0:
            start, end, valid_end = 0, context_len, context_len
        else:
            start, valid_end = context_len, seq_len
            end = tl.minimum(seq_len, context_len + tile_start + BLOCK_M) if CAUSAL else seq_len
        for start_n in range(start, end, BLOCK_N):
            k_pos = start_n + tl.arange(0, BLOCK_N)
            k_valid = k_pos < valid_end
            block = tl.load(table_ptr + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
            slot = k_pos % block_size
            kv_mask = k_valid[:, None] & d_mask[None, :]
            k_offs = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
            k = tl.load(k_cache_ptr + k_offs + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
            v = tl.load(v_cache_ptr + v_offs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)

            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2e
            visible = k_valid[None, :]  # the key-length mask (what vLLM's first non-causal version lacked)
            if phase == 1 and CAUSAL:
                visible = visible & (q_pos[:, None] >= k_pos[None, :])
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            m_i = m_new

    o_offs = rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    result = acc / l_i[:, None]
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

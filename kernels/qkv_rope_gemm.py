"""The attention's input side of a decoder layer in one Triton kernel: (add +) RMSNorm, the QKV projection,
Qwen3's per-head q/k norm, RoPE, and the paged K/V write.

One program owns BLOCK_M rows times one head of the fused qkv_proj output (query, key or value head), or, as a
GEMV without Qwen3's q/k norm, BLOCK_HALF columns of each of the head's halves (more, smaller programs: each
loads its whole weight slice before PDL's wait): it accumulates the two halves' columns as two dots (rotate-half
RoPE pairs element d with d + D/2, so each half is its own accumulator), rounds them to the model's dtype as the
GEMM's output would be, then
- a query head: (q-norms and) rotates, and stores into q [M, Hq, D];
- a key head: (k-norms and) rotates, and stores at each row's slot of the key cache;
- a value head: stores at each row's slot of the value cache.
Rows whose slot is -1 store no key or value. The prologue (the residual add and the RMSNorm, or two inputs normed
side by side) is small_gemm's. Without query heads (DFlash's context) it projects and stores keys and values only.
What it replaces: a norm, a GEMM, and the RoPE + cache-write kernel (kernels in
executor_service/models/rotary_cache.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_for_inputs
from kernels.small_gemm import (
    block_m,
    check_concat,
    dot_precision,
    dot_upcast,
    mma,
    prologue_rstd,
    prologue_tile,
    weight_tile,
)
from kernels.small_gemm_table import DEFAULT_CONFIG, GemmConfig


# Any row count, and slot mappings that start anywhere (a step's slots are sliced per part): one compile per bucket.
@triton.jit(do_not_specialize=["rows", "slot_ptr"])
def _qkv_rope_kernel(
    x_ptr, r_ptr, h_ptr, nw_ptr, x2_ptr, nw2_ptr, w_ptr, b_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr,
    v_cache_ptr, slot_ptr, rows, K1, K, eps, head_eps, stride_x, stride_r, stride_h, stride_x2, stride_w, stride_qt,
    stride_qh, stride_ct, stride_slot, stride_cb, stride_cs, stride_ch, block_size,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, CONCAT: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
    GEMV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = chunk * BLOCK_HALF + tl.arange(0, BLOCK_HALF)  # this program's columns of each half of the head
    d_mask = offs_d < HALF
    m_mask = offs_m < rows
    lo_rows = head * 2 * HALF + offs_d  # the head's weight rows: its first half, then (+ HALF) its second
    # Each K step's weights are loaded a step ahead; the first step's before the wait (they depend on nothing).
    w_lo = weight_tile(w_ptr, 0, lo_rows, d_mask, 0, K, stride_w, BLOCK_K)
    w_hi = weight_tile(w_ptr, HALF, lo_rows, d_mask, 0, K, stride_w, BLOCK_K)
    wait_for_inputs(PDL)
    rstd, rstd2 = prologue_rstd(
        x_ptr, r_ptr, h_ptr, x2_ptr, stride_x, stride_r, stride_h, stride_x2, offs_m, rows, K1, K, eps,
        (head == 0) & (chunk == 0),
        NORM, HAS_RESIDUAL, CONCAT, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    lo = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
    hi = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = prologue_tile(
            x_ptr, r_ptr, nw_ptr, x2_ptr, nw2_ptr, stride_x, stride_r, stride_x2, offs_m, offs_k, rows, K1, K, rstd,
            rstd2, NORM, HAS_RESIDUAL, CONCAT,
        )  # fmt: skip
        lo = mma(a, w_lo, lo, PRECISION, UPCAST, GEMV)
        hi = mma(a, w_hi, hi, PRECISION, UPCAST, GEMV)
        w_lo = weight_tile(w_ptr, 0, lo_rows, d_mask, k0 + BLOCK_K, K, stride_w, BLOCK_K)
        w_hi = weight_tile(w_ptr, HALF, lo_rows, d_mask, k0 + BLOCK_K, K, stride_w, BLOCK_K)
    if HAS_BIAS:
        lo += tl.load(b_ptr + lo_rows, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(b_ptr + lo_rows + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    dtype = q_ptr.dtype.element_ty
    lo = lo.to(dtype).to(tl.float32)  # what the GEMM would have written
    hi = hi.to(dtype).to(tl.float32)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # a query or key head: rotated
        if QK_NORM:
            head_rstd = 1.0 / tl.sqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + head_eps)
            if head < NUM_Q_HEADS:  # (fresh names: a runtime branch may not retype the loop's w_lo)
                norm_lo = tl.load(qn_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                norm_hi = tl.load(qn_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            else:
                norm_lo = tl.load(kn_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
                norm_hi = tl.load(kn_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
            lo = (lo * head_rstd[:, None] * norm_lo[None, :]).to(dtype).to(tl.float32)
            hi = (hi * head_rstd[:, None] * norm_hi[None, :]).to(dtype).to(tl.float32)
        cs_offs = offs_m[:, None] * stride_ct + offs_d[None, :]
        cs_mask = m_mask[:, None] & d_mask[None, :]
        cos = tl.load(cos_ptr + cs_offs, mask=cs_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs_offs, mask=cs_mask, other=0.0).to(tl.float32)
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    if head < NUM_Q_HEADS:
        dst = q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        mask = m_mask[:, None] & d_mask[None, :]
        tl.store(dst, lo.to(dtype), mask=mask)
        tl.store(dst + HALF, hi.to(dtype), mask=mask)
    else:
        kv_head = (head - NUM_Q_HEADS) % NUM_KV_HEADS
        slot = tl.load(slot_ptr + offs_m * stride_slot, mask=m_mask, other=-1).to(tl.int64)
        base = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + kv_head * stride_ch
        mask = (m_mask & (slot >= 0))[:, None] & d_mask[None, :]
        offs = base[:, None] + offs_d[None, :]
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            tl.store(k_cache_ptr + offs, lo.to(dtype).to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_cache_ptr + offs + HALF, hi.to(dtype).to(k_cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(v_cache_ptr + offs, lo.to(dtype).to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + offs + HALF, hi.to(dtype).to(v_cache_ptr.dtype.element_ty), mask=mask)


def qkv_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    config: GemmConfig = DEFAULT_CONFIG,
    x2: torch.Tensor | None = None,
    norm_weight2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, Hq, D] rotated, stream = x + residual): x [M, K] normed as small_gemm's prologue does, projected by
    weight [(Hq + 2 Hkv) D, K] (q, k, v heads in that order), keys rotated and stored with the values at
    `slot_mapping` in the caches [blocks, block_size, Hkv, D]; cos, sin [M, 1, D/2] (RotaryEmbedding.lookup);
    `qk_norm`: (q_norm weight, k_norm weight, eps) for Qwen3. `x2`, `norm_weight2`: a concatenated input, as
    small_gemm's (EAGLE-3). num_q_heads may be 0 (DFlash's context: keys and values only, weight's k/v rows)."""
    if config.defer:
        raise ValueError("qkv_rope_store has no deferred GEMV (small_gemm's option)")
    x2, nw2, k1 = check_concat(x, residual, norm_weight, x2, norm_weight2)
    rows, K = x.shape[0], weight.shape[1]
    head_size = weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    half = head_size // 2
    q = torch.empty(rows, num_q_heads, head_size, dtype=x.dtype, device=x.device)
    stream = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    q_norm, k_norm, head_eps = qk_norm if qk_norm is not None else (x, x, 0.0)
    q_strides = (q.stride(0), q.stride(1)) if num_q_heads else (head_size, head_size)
    rows_per_program, use_pdl = block_m(rows, config), pdl.enabled(x.device)
    block_half = max(16, triton.next_power_of_2(half))
    if config.gemv and qk_norm is None:  # a GEMV's program takes block_n columns of each half (the q/k norm
        block_half = min(block_half, config.block_n)  # needs the whole head in one program)
    grid = (triton.cdiv(rows, rows_per_program), num_q_heads + 2 * num_kv_heads, triton.cdiv(half, block_half))
    _qkv_rope_kernel[grid](
        x, res, stream, norm_weight if norm_weight is not None else x, x2, nw2, weight,
        bias if bias is not None else x, q_norm, k_norm, cos, sin, q if num_q_heads else x, k_cache, v_cache,
        slot_mapping, rows, k1, K, eps, head_eps, x.stride(0), res.stride(0), stream.stride(0), x2.stride(0),
        weight.stride(0), *q_strides, cos.stride(0), slot_mapping.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_cache.shape[1],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, CONCAT=x2 is not x, HAS_BIAS=bias is not None,
        QK_NORM=qk_norm is not None, PDL=use_pdl, GEMV=config.gemv, PRECISION=dot_precision(x.dtype),
        UPCAST=dot_upcast(x), BLOCK_M=rows_per_program, BLOCK_HALF=block_half,
        BLOCK_K=config.block_k, num_warps=config.num_warps, **pdl.launch_options(use_pdl),
    )  # fmt: skip
    return q, stream

"""GEMMs of few rows (decode and verify: M = 1-64) as Triton kernels with the layer's small ops fused in.

At batch 1 a small model's decoder layer is launch-bound: its GEMMs (SmolLM2: N <= 3072, K <= 1536) take a
few microseconds each whatever they do, and so does each RMSNorm, residual add and SiLU-and-mul between them.
These kernels fold those ops into the GEMM itself:

- prologue: out = GEMM(rmsnorm(x + residual)); the first column tile's programs also store x + residual (the
  residual stream, rounded to x's dtype as torch's add rounds it). Every program reads its rows whole once for
  the statistics (fp32), then again, normed and rounded, as the dot's left operand: the same values the
  standalone RMSNorm kernel would have written.
- concatenated input (CONCAT): the left operand is [rmsnorm(x) | rmsnorm(x2)], two tensors side by side, each
  normed over its own columns with its own weight (EAGLE-3's attention input) or taken as is (EAGLE-1's fc over
  [embedding | hidden]); no residual. It replaces the two norms and the concatenation copy.
- epilogue: the bias, or SiLU-and-mul over [gate | up] (each program computes a gate tile and the matching up
  tile, both rounded to the output dtype first, as the GEMM then the separate kernel would).

No split-K: with the residual, the norm and the activation fused, partial sums would need an fp32 buffer, a
memset and a final pass, three launches where one is the point. Tile shapes come from kernels/small_gemm_table.py.

A GEMV program (a few rows on the CUDA cores) sums each K step's products across its threads: the reduction
crosses warps, through shared memory and a barrier at every step. With `defer` (large K: the 8B shapes' shards)
each thread adds its products into its own slots of a [rows, BLOCK_K, BLOCK_N] accumulator and the program sums
across threads once, after the last step, so the loads of the next steps are never held up by a barrier.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import wait_for_inputs
from kernels.small_gemm_table import DEFAULT_CONFIG, GemmConfig

BLOCK_M = 16  # tl.dot's smallest tile side; rows past M are masked
MMA_BLOCK_MS = (16, 32, 64)  # an MMA config's block_m: rows per program (0: BLOCK_M)
MAX_GEMV_ROWS = 8  # a GEMV program takes at most this many rows (its config's block_m, or all): decode batches
# and a k = 7 chain's verify rows at batch 1
MAX_DEFER_ROWS = 2  # a deferred GEMV's accumulator holds rows x BLOCK_K x BLOCK_N fp32 values


def block_m(rows: int, config: GemmConfig) -> int:
    """Rows a program takes: an MMA's 16 (or its config's block_m: 32 or 64), or a GEMV's rows (at most its
    config's block_m) rounded up to a power of two."""
    if config.gemv:
        per_program = min(rows, config.block_m) if config.block_m else rows
        limit = MAX_DEFER_ROWS if config.defer else MAX_GEMV_ROWS
        if per_program > limit:
            raise ValueError(
                f"a{' deferred' * config.defer} GEMV program takes at most {limit} rows, got {per_program}"
            )
        return triton.next_power_of_2(per_program)
    if config.defer:
        raise ValueError("defer is a GEMV's option")
    if config.block_m not in (0, *MMA_BLOCK_MS):
        raise ValueError(f"an MMA program takes 16, 32 or 64 rows, not {config.block_m}")
    return config.block_m or BLOCK_M


@triton.jit
def mma(a, w, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr, GEMV: tl.constexpr = False):
    """acc + a @ w. UPCAST (Triton's CPU interpreter only, whose bf16/fp16 dot returns garbage): the same
    products in fp32, exact for 16-bit inputs; only the summation order can differ from the GPU's MMA.
    GEMV (a few rows: BLOCK_M is the rows' bucket, not the MMA's 16): fp32 products summed across the threads,
    no tensor cores and no padding rows."""
    if GEMV:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def products(a, w, part):
    """part + each product of a [BLOCK_M, BLOCK_K] and w [BLOCK_K, BLOCK_N], in fp32 and unsummed: a deferred
    GEMV's step (summed over K once, after the last)."""
    return part + a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :]


@triton.jit
def row_rstd(
    x_ptr, r_ptr, h_ptr, stride_x, stride_r, stride_h, offs_m, rows, K, eps, store_h,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """1 / rms of each row of h = x (+ residual), in fp32; h stored where `store_h` (one column tile does)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < rows) & (offs_k[None, :] < K)
        h = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if store_h:
                tl.store(h_ptr + offs_m[:, None] * stride_h + offs_k[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        squares += tl.sum(hf * hf, 1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def a_tile(
    x_ptr, r_ptr, nw_ptr, stride_x, stride_r, offs_m, offs_k, rows, K, rstd,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The dot's left operand [BLOCK_M, BLOCK_K]: rmsnorm(x + residual) rounded to x's dtype (or x as is)."""
    mask = (offs_m[:, None] < rows) & (offs_k[None, :] < K)
    a = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if NORM:
        w = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * rstd[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
    return a


@triton.jit
def concat_a_tile(
    x_ptr, x2_ptr, nw_ptr, nw2_ptr, stride_x, stride_x2, offs_m, offs_k, rows, K1, K, rstd, rstd2, NORM: tl.constexpr
):
    """The left operand of a concatenated input: columns < K1 from x (normed with rstd, nw), the rest from x2
    (with rstd2, nw2). Each side's out-of-range columns load as 0 and are dropped by the select."""
    first = a_tile(x_ptr, x_ptr, nw_ptr, stride_x, stride_x, offs_m, offs_k, rows, K1, rstd, NORM, False)
    offs_k2 = tl.where(offs_k >= K1, offs_k - K1, K - K1)  # the first segment's columns: masked out
    second = a_tile(x2_ptr, x2_ptr, nw2_ptr, stride_x2, stride_x2, offs_m, offs_k2, rows, K - K1, rstd2, NORM, False)
    return tl.where((offs_k < K1)[None, :], first, second)


@triton.jit
def prologue_rstd(
    x_ptr, r_ptr, h_ptr, x2_ptr, stride_x, stride_r, stride_h, stride_x2, offs_m, rows, K1, K, eps, store_h,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CONCAT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """(rstd of x's rows or of x + residual, rstd of x2's rows): 1 where nothing is normed."""
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    rstd2 = tl.full([BLOCK_M], 1.0, tl.float32)
    if CONCAT:
        if NORM:
            rstd = row_rstd(
                x_ptr, x_ptr, x_ptr, stride_x, stride_x, stride_x, offs_m, rows, K1, eps, False, False, BLOCK_M,
                BLOCK_K,
            )  # fmt: skip
            rstd2 = row_rstd(
                x2_ptr, x2_ptr, x2_ptr, stride_x2, stride_x2, stride_x2, offs_m, rows, K - K1, eps, False, False,
                BLOCK_M, BLOCK_K,
            )  # fmt: skip
    elif NORM or HAS_RESIDUAL:
        rstd = row_rstd(
            x_ptr, r_ptr, h_ptr, stride_x, stride_r, stride_h, offs_m, rows, K, eps, store_h, HAS_RESIDUAL,
            BLOCK_M, BLOCK_K,
        )  # fmt: skip
    return rstd, rstd2


@triton.jit
def prologue_tile(
    x_ptr, r_ptr, nw_ptr, x2_ptr, nw2_ptr, stride_x, stride_r, stride_x2, offs_m, offs_k, rows, K1, K, rstd, rstd2,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CONCAT: tl.constexpr,
):  # fmt: skip
    """The dot's left operand for this K step, whichever prologue the kernel was built with."""
    if CONCAT:
        return concat_a_tile(
            x_ptr, x2_ptr, nw_ptr, nw2_ptr, stride_x, stride_x2, offs_m, offs_k, rows, K1, K, rstd, rstd2, NORM
        )
    return a_tile(x_ptr, r_ptr, nw_ptr, stride_x, stride_r, offs_m, offs_k, rows, K, rstd, NORM, HAS_RESIDUAL)


@triton.jit
def weight_tile(w_ptr, row0, offs_n, n_mask, k0, K, stride_w, BLOCK_K: tl.constexpr):
    """Rows row0 + offs_n of the weight [N, K], columns [k0, k0 + BLOCK_K), as the dot's right operand
    [BLOCK_K, BLOCK_N]; columns past K load nothing (0)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_k[:, None] < K) & n_mask[None, :]
    return tl.load(w_ptr + (row0 + offs_n[None, :]) * stride_w + offs_k[:, None], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["rows"])  # any row count: one compile per bucket
def _small_gemm_kernel(
    x_ptr, r_ptr, h_ptr, nw_ptr, x2_ptr, nw2_ptr, w_ptr, b_ptr, out_ptr, rows, N, K1, K, eps, up_offset,
    stride_x, stride_r, stride_h, stride_x2, stride_w, stride_o,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CONCAT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr, PDL: tl.constexpr, GEMV: tl.constexpr, DEFER: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Each K step's weights are loaded a step ahead; the first step's before the wait (they depend on nothing).
    w = weight_tile(w_ptr, 0, offs_n, n_mask, 0, K, stride_w, BLOCK_K)
    w_up = w
    if SILU_MUL:
        w_up = weight_tile(w_ptr, up_offset, offs_n, n_mask, 0, K, stride_w, BLOCK_K)
    wait_for_inputs(PDL)
    rstd, rstd2 = prologue_rstd(
        x_ptr, r_ptr, h_ptr, x2_ptr, stride_x, stride_r, stride_h, stride_x2, offs_m, rows, K1, K, eps, pid_n == 0,
        NORM, HAS_RESIDUAL, CONCAT, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DEFER:
        part = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
        if SILU_MUL:
            part_up = tl.zeros([BLOCK_M, BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = prologue_tile(
            x_ptr, r_ptr, nw_ptr, x2_ptr, nw2_ptr, stride_x, stride_r, stride_x2, offs_m, offs_k, rows, K1, K, rstd,
            rstd2, NORM, HAS_RESIDUAL, CONCAT,
        )  # fmt: skip
        if DEFER:
            part = products(a, w, part)
        else:
            acc = mma(a, w, acc, PRECISION, UPCAST, GEMV)
        w = weight_tile(w_ptr, 0, offs_n, n_mask, k0 + BLOCK_K, K, stride_w, BLOCK_K)
        if SILU_MUL:
            if DEFER:
                part_up = products(a, w_up, part_up)
            else:
                acc_up = mma(a, w_up, acc_up, PRECISION, UPCAST, GEMV)
            w_up = weight_tile(w_ptr, up_offset, offs_n, n_mask, k0 + BLOCK_K, K, stride_w, BLOCK_K)
    if DEFER:
        acc = tl.sum(part, 1)
        if SILU_MUL:
            acc_up = tl.sum(part_up, 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    out_mask = (offs_m[:, None] < rows) & n_mask[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get fp32 products (tl.dot would use TF32 on Ampere and later), as cuBLAS gives torch."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(x: torch.Tensor) -> bool:
    """16-bit dots in fp32, under the interpreter only (see `mma`)."""
    return x.device.type == "cpu" and x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"


def small_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    config: GemmConfig = DEFAULT_CONFIG,
    x2: torch.Tensor | None = None,
    norm_weight2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, stream): out = epilogue(prologue(x) @ weight.T (+ bias)), where prologue(x) = rmsnorm(x + residual)
    with `norm_weight` (x + residual, or x, without it) and the epilogue is SiLU-and-mul over weight's
    [gate | up] halves when `silu_mul`; stream = x + residual (x itself without a residual). x [M, K] and
    weight [N, K] with unit inner strides. With `x2` [M, K2] (and no residual) the input is the concatenation
    [rmsnorm(x, norm_weight) | rmsnorm(x2, norm_weight2)] (both norms or neither), weight [N, K + K2]."""
    if silu_mul and bias is not None:
        raise ValueError("small_gemm: a bias with SiLU-and-mul is not supported (no model's gate_up has one)")
    x2, nw2, k1 = check_concat(x, residual, norm_weight, x2, norm_weight2)
    rows, K = x.shape[0], weight.shape[1]
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    stream = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    nw = norm_weight if norm_weight is not None else x
    rows_per_program, use_pdl = block_m(rows, config), pdl.enabled(x.device)
    grid = (triton.cdiv(rows, rows_per_program), triton.cdiv(n_out, config.block_n))
    _small_gemm_kernel[grid](
        x, res, stream, nw, x2, nw2, weight, bias if bias is not None else x, out,
        rows, n_out, k1, K, eps, n_out, x.stride(0), res.stride(0), stream.stride(0), x2.stride(0), weight.stride(0),
        out.stride(0), NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, CONCAT=x2 is not x,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PDL=use_pdl, GEMV=config.gemv, DEFER=config.defer,
        PRECISION=dot_precision(x.dtype), UPCAST=dot_upcast(x), BLOCK_M=rows_per_program, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps, **pdl.launch_options(use_pdl),
    )  # fmt: skip
    return out, stream


def check_concat(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    x2: torch.Tensor | None,
    norm_weight2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x2 or x itself, norm_weight2 or a dummy, x's columns): the kernels' arguments for a concatenated input
    (x2 given) or a single one (x2 is x: CONCAT off)."""
    if x2 is None:
        return x, x, x.shape[1]
    if residual is not None or (norm_weight is None) != (norm_weight2 is None):
        raise ValueError("a concatenated input takes no residual, and both norms or neither")
    if x2.shape[0] != x.shape[0] or x2.dtype != x.dtype or x2.stride(-1) != 1:
        raise ValueError("x2 must have x's rows and dtype and unit inner stride")
    return x2, norm_weight2 if norm_weight2 is not None else x, x.shape[1]

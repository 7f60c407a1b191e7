"""The small ops around the GEMMs, as one Triton kernel each on GPUs: RMSNorm, residual add + RMSNorm, two
RMSNorms written side by side (EAGLE-3's attention input), SiLU-and-mul, argmax; and the residual add folded into
the GEMM before it (linear_residual).

At batch 1 a decode step is bandwidth-bound GEMMs plus about ten small kernels per layer. On an H100 torch's
RMSNorm took 5.8 µs a row of 4096 (65 per Llama-3-8B step), SiLU and the multiply were two kernels, and an
argmax over a 128k vocabulary ran in one thread block for 36 µs. Each function here falls back to the plain
torch expression on the CPU (or for layouts the kernel does not take), which is also the tests' reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ARGMAX_CHUNK = 4096  # vocabulary entries per program in the first argmax pass


def _use_triton(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.dim() == 2 and t.stride(-1) == 1 and t.shape[0] > 0 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, statistics in fp32."""
    if _use_triton(x):
        return triton_rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the decoder layers leave each sublayer's residual add to the
    norm after it, so one kernel reads both and writes both. Without a residual: (rms_norm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if _use_triton(x, residual):
        return triton_add_rms_norm(x, residual, weight, eps)
    stream = x + residual
    return F.rms_norm(stream, weight.shape, weight, eps), stream


def concat_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor, eps: float
) -> torch.Tensor:
    """[rms_norm(x, weight) | rms_norm(x2, weight2)] along the last dimension: one kernel instead of two norms and
    the concatenation's copy."""
    if _use_triton(x, x2):
        return triton_concat_rms_norm(x, weight, x2, weight2, eps)
    return torch.cat([F.rms_norm(x, weight.shape, weight, eps), F.rms_norm(x2, weight2.shape, weight2, eps)], dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (vLLM's SiluAndMul)."""
    if _use_triton(gate_up):
        return triton_silu_and_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def linear_residual(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + layer(x) as one GEMM (beta = 1: cuBLAS adds the residual in its epilogue) instead of a GEMM
    and an add kernel, twice per layer. A tensor-parallel row-parallel layer adds the residual itself,
    on one rank only, before its all-reduce (parallel/layers.py)."""
    reduces = getattr(layer, "residual_forward", None)
    if reduces is not None:
        return reduces(x, residual)
    if residual is None:
        return layer(x)
    if layer.bias is not None:
        return residual + layer(x)
    return torch.addmm(residual, x, layer.weight.t())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [N, V] -> [N] int64: the first index of the maximum, as torch.argmax."""
    if _use_triton(logits):
        return triton_argmax(logits)
    return logits.argmax(dim=-1)


def checked_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [N], finite [N] bool): whether each row's maximum is finite, i.e. the row holds no NaN or +inf and
    is not all -inf (the logits checks of verification). The fused kernels find both in one read of the row; torch's
    argmax alone took 28 us a step on a batch-1 row of 128k logits (an 8B target's)."""
    if _use_triton(logits):
        return triton_checked_argmax(logits)
    ids = logits.argmax(dim=-1)  # torch's argmax finds a NaN (or +inf) where there is one
    return ids, torch.isfinite(logits.gather(-1, ids[:, None])[:, 0])


def packed_checked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """checked_argmax as one int64 tensor [2N]: [finite (0 / 1) | argmax], what a greedy decode step reads back;
    the fused kernels write it in place (no cast and concatenation after them)."""
    if _use_triton(logits):
        packed = torch.empty(2 * logits.shape[0], dtype=torch.int64, device=logits.device)
        triton_checked_argmax(logits, packed=packed)
        return packed
    ids, finite = checked_argmax(logits)
    return torch.cat([finite.long(), ids])


# The launchers: on GPUs, or on the CPU under TRITON_INTERPRET=1 (the kernel tests).
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    size = x.shape[1]
    block = next_power_of_2(size)
    _kernels()["rms_norm"][(x.shape[0],)](
        x, weight, out, x.stride(0), out.stride(0), size, eps, BLOCK=block, num_warps=row_warps(block)
    )
    return out


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, stream = torch.empty_like(x), torch.empty_like(x)
    size = x.shape[1]
    block = next_power_of_2(size)
    _kernels()["add_rms_norm"][(x.shape[0],)](
        x, residual, weight, out, stream, x.stride(0), residual.stride(0), out.stride(0), stream.stride(0), size,
        eps, BLOCK=block, num_warps=row_warps(block),
    )  # fmt: skip
    return out, stream


def triton_concat_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor, eps: float
) -> torch.Tensor:
    size, size2 = x.shape[1], x2.shape[1]
    out = torch.empty(x.shape[0], size + size2, dtype=x.dtype, device=x.device)
    block = next_power_of_2(max(size, size2))
    _kernels()["concat_rms_norm"][(x.shape[0], 2)](
        x, weight, x2, weight2, out, x.stride(0), x2.stride(0), out.stride(0), size, size2, eps, BLOCK=block,
        num_warps=row_warps(block),
    )  # fmt: skip
    return out


def triton_silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    out = torch.empty(gate_up.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    grid = (gate_up.shape[0], -(-half // block))
    _kernels()["silu_and_mul"][grid](gate_up, out, gate_up.stride(0), out.stride(0), half, BLOCK=block, num_warps=4)
    return out


def triton_argmax(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """Two passes, so that a handful of rows still spread over the whole GPU: the maximum of each chunk of
    the vocabulary, then of the chunks."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch_argmax(logits, chunk, out, None)
    return out


def triton_checked_argmax(
    logits: torch.Tensor, chunk: int = ARGMAX_CHUNK, packed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, finite) as checked_argmax, the chunks also telling whether they hold a NaN or +inf; `packed`
    (int64 [2N]): written as [finite | argmax] instead, its halves returned. A row with a NaN has an unspecified
    argmax here (torch's is the NaN's index); it is not finite either way."""
    rows = logits.shape[0]
    if packed is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        finite = torch.empty(rows, dtype=torch.bool, device=logits.device)
    else:
        finite, out = packed[:rows], packed[rows:]
    _launch_argmax(logits, chunk, out, finite)
    return out, finite


def _launch_argmax(logits: torch.Tensor, chunk: int, out: torch.Tensor, finite: torch.Tensor | None) -> None:
    """The two argmax kernels into `out`; where `finite` is given, the NaN / +inf check into it too (the plain
    argmax, the drafter's picks and greedy verification, skips that reduction)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    partial_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    partial_idx = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    check = finite is not None
    partial_bad = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device) if check else partial_idx
    kernels = _kernels()
    kernels["argmax_chunks"][(rows, chunks)](
        logits, partial_max, partial_idx, partial_bad, logits.stride(0), vocab, chunks, CHECK=check, BLOCK=chunk,
        num_warps=8,
    )  # fmt: skip
    kernels["argmax_combine"][(rows,)](
        partial_max, partial_idx, partial_bad, out, finite if check else out, chunks, CHECK=check,
        BLOCK=next_power_of_2(chunks),
    )  # fmt: skip


def next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def row_warps(block: int) -> int:
    """Warps of a one-row-a-program kernel over `block` columns: one per 512, 1 to 16."""
    return min(16, max(1, block // 512))


@functools.cache
def _kernels() -> dict[str, Callable[..., Any]]:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, size, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < size
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / size + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, stride_x, stride_r, stride_o, stride_h, size, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < size
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)  # rounded as torch's add rounds it
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / size + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def concat_rms_norm_kernel(
        x_ptr, w_ptr, x2_ptr, w2_ptr, out_ptr, stride_x, stride_x2, stride_o, size, size2, eps, BLOCK: tl.constexpr
    ):
        row, side = tl.program_id(0).to(tl.int64), tl.program_id(1)  # side 0: x into out[:size]; 1: x2 after it
        offs = tl.arange(0, BLOCK)
        if side == 0:
            n, src, w, dst = size, x_ptr + row * stride_x, w_ptr, out_ptr + row * stride_o
        else:
            n, src, w, dst = size2, x2_ptr + row * stride_x2, w2_ptr, out_ptr + row * stride_o + size
        mask = offs < n
        h = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
        weight = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + offs, (h * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < half
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + half + offs, mask=mask, other=0.0).to(tl.float32)
        result = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + offs, result.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def argmax_chunks_kernel(
        x_ptr, max_ptr, idx_ptr, bad_ptr, stride_x, vocab, chunks, CHECK: tl.constexpr, BLOCK: tl.constexpr
    ):
        row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        best = tl.max(x, 0)
        first = tl.min(tl.where(x == best, offs, vocab), 0)  # the lowest index holding the maximum
        tl.store(max_ptr + row * chunks + chunk, best)
        tl.store(idx_ptr + row * chunks + chunk, first.to(tl.int64))
        if CHECK:  # NaN or +inf in the chunk
            tl.store(bad_ptr + row * chunks + chunk, tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0))

    # `packed` puts the argmax right after a batch's finite flags: at an odd batch 8 bytes off alignment, which
    # would compile the kernel again mid-run.
    @triton.jit(do_not_specialize=["out_ptr", "finite_ptr"])
    def argmax_combine_kernel(
        max_ptr, idx_ptr, bad_ptr, out_ptr, finite_ptr, chunks, CHECK: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < chunks
        best = tl.load(max_ptr + row * chunks + offs, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + row * chunks + offs, mask=mask, other=0)
        top = tl.max(best, 0)
        big = tl.full([BLOCK], 2**62, tl.int64)
        tl.store(out_ptr + row, tl.min(tl.where(mask & (best == top), idx, big), 0))
        if CHECK:
            bad = tl.sum(tl.load(bad_ptr + row * chunks + offs, mask=mask, other=0), 0)
            tl.store(finite_ptr + row, (bad == 0) & (top > float("-inf")))

    return {
        "rms_norm": rms_norm_kernel,
        "add_rms_norm": add_rms_norm_kernel,
        "concat_rms_norm": concat_rms_norm_kernel,
        "silu_and_mul": silu_and_mul_kernel,
        "argmax_chunks": argmax_chunks_kernel,
        "argmax_combine": argmax_combine_kernel,
    }

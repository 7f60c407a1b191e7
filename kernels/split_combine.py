"""Split-KV's combine for TRITON_ATTN: the partial results of a request's key parts into one output.

out = sum_s 2^(lse_s - lse) * out_s with lse = log2 sum_s 2^lse_s, where out_s is part s's normalised output and
lse_s its log-sum-exp (base 2); an empty part has lse -inf and adds nothing.

Two ways to run it. With a counters buffer (int32, zero between calls, one counter per request and head block)
the attention kernel combines itself: each program that owns a non-empty part writes its partials, then adds 1
to its (request, head block) counter; the program that arrives last combines the partials into the output and
sets the counter back to 0. The release half of that atomic publishes the stores before it (a barrier first
makes every thread's stores precede it), the acquire half shows the last program every other program's, and
the partials are read past L1 (`.cg`), so none is read stale. Without a buffer (or one too small for the
launch) a second kernel, `_combine_splits_kernel`, combines every part after the attention kernel finished.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import wait_for_inputs


@triton.jit
def arrive_and_combine(
    counter_ptr, participants, partial_ptr, lse_ptr, out_ptr, lse_rows, out_rows, row_mask, n_used,
    stride_split_o, stride_split_lse, BLOCK_M: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Called by every program that wrote partials of this (request, head block), after writing them: the last
    of the `participants` to arrive combines parts 0 .. n_used - 1 of its rows into out and zeroes the counter.
    `lse_rows`: the rows' (token x heads + head) in lse [S, T, H] and partial [S, T, H, HEAD_SIZE]; `out_rows`:
    their offsets in out."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == participants - 1:
        offs_s = tl.arange(0, NUM_SPLITS)
        lse = tl.load(
            lse_ptr + offs_s[:, None] * stride_split_lse + lse_rows[None, :],
            mask=(offs_s < n_used)[:, None] & row_mask[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)  # padding rows: nothing to weigh
        offs_d = tl.arange(0, HEAD_PAD)
        mask = row_mask[:, None] & (offs_d < HEAD_SIZE)[None, :]
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for part in range(0, n_used):
            part_lse = tl.load(lse_ptr + part * stride_split_lse + lse_rows, mask=row_mask, other=float("-inf"),
                               cache_modifier=".cg")  # fmt: skip
            weight = tl.math.exp2(part_lse - lse_max)
            offs = part * stride_split_o + lse_rows[:, None] * HEAD_SIZE + offs_d[None, :]
            acc += tl.load(partial_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg") * weight[:, None]
            total += weight
        total = tl.where(total > 0.0, total, 1.0)
        out = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out, mask=mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # zero again for the next call (graph replay)


@triton.jit
def _combine_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, num_heads, head_size,
    stride_split_o, stride_split_lse, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (token, head) over all NUM_SPLITS parts (the attention kernel wrote every one)."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    row = token * num_heads + head
    lse = tl.load(lse_ptr + offs_s * stride_split_lse + row)
    lse_max = tl.max(lse, 0)
    weights = tl.math.exp2(lse - lse_max)
    weights = weights / tl.sum(weights, 0)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < head_size
    partial = tl.load(
        partial_ptr + offs_s[:, None] * stride_split_o + row * head_size + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )
    result = tl.sum(partial * weights[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def combine_splits(
    partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, head_pad: int, use_pdl: bool, launch: dict
) -> None:
    """The second kernel: partial [S, T, H, D] and lse [S, T, H] (every part written) into out [T, H, D]."""
    num_splits, num_tokens, num_heads, head_size = partial.shape
    _combine_splits_kernel[(num_tokens, num_heads)](
        partial, lse, out, num_heads, head_size,
        partial.stride(0), lse.stride(0), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_PAD=head_pad, PDL=use_pdl, **launch,
    )  # fmt: skip

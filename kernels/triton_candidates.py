"""The drafter's top-k log-probabilities and their ids in one Triton launch (tree drafting's candidates per depth).

`logits.log_softmax(-1, dtype=float32).topk(k)` is a softmax kernel (one block per row) and, on CUDA, a
multi-block radix select of several kernels, plus a gather for EAGLE-3's draft-to-target map: at batch 1 a
dynamic tree step pays those launches at every depth. Here one program per row loads its logits once (a row of
up to MAX_TILE entries stays in registers; longer rows, such as EAGLE-1's full vocabulary, are read again per
round in tiles), takes the row's max and log-sum-exp in float32, then k rounds of one max-reduction each.

Each entry becomes one int64 key: its float32 value's bits made order-preserving as a signed integer in the
high half, (2^31 - 1 - index) in the low half. Keys are distinct, so round r's pick is the largest key below
round r - 1's: no mask of the picked entries to write back. Equal values rank LOWEST INDEX FIRST (torch.topk
leaves that order unspecified on CUDA); -0.0 ranks below +0.0. No host sync, fixed output shapes, nothing
allocated but the outputs: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The rounds run one after the other, one reduction each: past a few dozen torch's radix select is the better
# tool. Trees take at most 16 children per node (selection/draft_tree.py's MAX_TREE_TOP_K).
MAX_K = 16
MAX_TILE = 16384  # the longest row one program holds in registers (16 warps: 32 entries a thread)
LONG_ROW_TILE = 4096  # longer rows' tiles (8 warps: the lane-wise max, sum and best key of 16 entries a thread)
MAX_VOCAB = 0x7FFFFFFF  # a key's low half holds 0x7FFFFFFF - index


def unavailable_reason(device: torch.device) -> str | None:
    """None where the kernel runs: CUDA/ROCm devices, or the CPU under TRITON_INTERPRET=1 (the tests)."""
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return f"triton needs a CUDA/ROCm device (or TRITON_INTERPRET=1 on the CPU), got {device.type}"


@triton.jit
def _keys(x, offs):
    """Order-preserving int64 keys of float32 values: the value's bits (a negative's magnitude bits flipped),
    then the index reversed, so that of equal values the lowest index has the largest key."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - offs.to(tl.int64))


@triton.jit
def _topk_log_softmax_kernel(
    logits_ptr, to_target_ptr, scores_ptr, ids_ptr, stride_row, vocab,
    K: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr, SCORES: tl.constexpr, MAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    lse = tl.zeros((), tl.float32)
    if ONE_TILE:
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        keys = _keys(x, offs)  # past the row: -inf at an index past V, below every real entry
        if SCORES:
            top = tl.max(x, 0)
            lse = top + tl.log(tl.sum(tl.exp(x - top), 0))
    elif SCORES:  # per-lane online max and sum over the tiles, reduced once
        lane_top = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(lane_top, x)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a lane of -inf so far adds nothing
            lane_sum = lane_sum * tl.exp(lane_top - shift) + tl.exp(x - shift)
            lane_top = new_top
        top = tl.max(lane_top, 0)
        lane_sum = tl.where(lane_top == float("-inf"), 0.0, lane_sum * tl.exp(lane_top - top))
        lse = top + tl.log(tl.sum(lane_sum, 0))
    bound = tl.full((), 0x7FFFFFFFFFFFFFFF, tl.int64)  # the last pick's key: the next is the largest below it
    for r in tl.static_range(K):
        if ONE_TILE:
            best = tl.max(tl.where(keys < bound, keys, -0x7FFFFFFFFFFFFFFF), 0)
        else:  # per-lane best over the tiles, reduced once
            lane_best = tl.full([BLOCK], -0x7FFFFFFFFFFFFFFF, tl.int64)
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
                tile_keys = _keys(x, start + offs)
                lane_best = tl.maximum(lane_best, tl.where(tile_keys < bound, tile_keys, -0x7FFFFFFFFFFFFFFF))
            best = tl.max(lane_best, 0)
        bound = best
        index = 0x7FFFFFFF - (best & 0x7FFFFFFF)
        if SCORES:
            tl.store(scores_ptr + row * K + r, tl.load(base + index).to(tl.float32) - lse)
        if MAP:
            tl.store(ids_ptr + row * K + r, tl.load(to_target_ptr + index).to(tl.int64))
        else:
            tl.store(ids_ptr + row * K + r, index.to(tl.int64))


def topk_log_softmax(
    logits: torch.Tensor, k: int, to_target: torch.Tensor | None = None, scores: bool = True, tile: int = MAX_TILE
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`logits.log_softmax(-1, dtype=float32).topk(k)` of logits [N, V] (bf16/fp16/fp32) in one launch: the
    log-probabilities float32 [N, k] (None without `scores`: the ranking alone, as a static tree's) and the ids
    int64 [N, k], mapped through `to_target` [V] when given; best first, equal values lowest index first.
    Rows longer than `tile` (a power of two; the tests shrink it) are read in tiles of it, once per round."""
    rows, vocab = logits.shape
    assert 1 <= k <= min(MAX_K, vocab), f"k must be in [1, min({MAX_K}, vocab = {vocab})], got {k}"
    assert vocab < MAX_VOCAB and tile > 0 and tile & (tile - 1) == 0
    assert logits.stride(-1) == 1, "each row's entries must be contiguous"
    if to_target is not None:
        assert to_target.shape == (vocab,) and to_target.is_contiguous(), "to_target: one id per entry, [V]"
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(rows, k, dtype=torch.float32, device=logits.device) if scores else None
    if rows == 0:
        return log_probs, ids
    block = triton.next_power_of_2(vocab)
    one_tile = block <= tile
    if not one_tile:
        block = min(tile, LONG_ROW_TILE)
    _topk_log_softmax_kernel[(rows,)](
        logits, ids if to_target is None else to_target, ids if log_probs is None else log_probs, ids,
        logits.stride(0), vocab,
        K=k, BLOCK=block, ONE_TILE=one_tile, SCORES=scores, MAP=to_target is not None,
        num_warps=min(16, max(4, block // 1024)) if one_tile else 8,
    )  # fmt: skip
    return log_probs, ids

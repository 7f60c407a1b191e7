"""The drafter's top-k candidates in one Triton launch: log-softmax, top-k and the id map together.

A tree proposal ranks the drafter's vocabulary once per depth. In torch that is a softmax kernel (one block per
row), a radix top-k of six to eight launches and a gather through EAGLE-3's draft-to-target map: about ten small
kernels per depth at batch 1. Here one program per row computes, in fp32, the row's maximum and log-sum-exp, then
k rounds of argmax: round r takes the largest entry that ranks below round r - 1's pick. Entries are ranked by
value, then by the LOWER index first (torch.topk leaves the order of equal values unspecified on CUDA), through
one int64 key per entry (the value's order-preserving bits above, the index's complement below), so a round is
one max-reduction and needs no mask of the entries taken so far.

Rows up to ONE_BLOCK_VOCAB entries stay in registers; longer ones (EAGLE-1 ranks the target's vocabulary) are
read again per round in CHUNK-wide pieces. Fixed output shapes, no host sync, nothing allocated but the outputs:
CUDA-graph capturable. Runs on GPUs, or on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16  # the widest tree level (selection.draft_tree.MAX_TREE_TOP_K): each candidate is one more pass
ONE_BLOCK_VOCAB = 16384  # rows up to this many entries are loaded once
CHUNK = 8192  # entries per piece of a longer row
MAX_INDEX = 2**31 - 1  # the key's low half holds MAX_INDEX - index


def topk_log_softmax(
    logits: torch.Tensor, k: int, to_target: torch.Tensor | None = None, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` of each row of `logits` [N, V] (bf16, fp16 or fp32), best first, equal values lowest index
    first: their log-probabilities (float32 [N, k]; with `normalize=False` the logits themselves, as float32,
    which skips the log-sum-exp) and their ids (int64 [N, k]), mapped through `to_target` (int64 [V]) if given."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, V] with V contiguous, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"k must be in [1, min({MAX_K}, V = {vocab})], got {k}")
    if vocab > MAX_INDEX:
        raise ValueError(f"V must be below 2^31, got {vocab}")
    if to_target is not None and (to_target.shape != (vocab,) or to_target.dtype != torch.int64):
        raise ValueError(f"to_target must be int64 [V = {vocab}], got {to_target.dtype} {tuple(to_target.shape)}")
    values = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return values, ids
    one_block = vocab <= ONE_BLOCK_VOCAB
    block = triton.next_power_of_2(vocab) if one_block else CHUNK
    _topk_log_softmax_kernel[(rows,)](
        logits, ids if to_target is None else to_target, values, ids, logits.stride(0), vocab, k,
        BLOCK=block, ONE_BLOCK=one_block, NORMALIZE=normalize, MAPPED=to_target is not None,
        MAX_INDEX=MAX_INDEX, num_warps=min(16, max(4, block // 1024)),
    )  # fmt: skip
    return values, ids


@triton.jit
def _order_keys(x, index, MAX_INDEX: tl.constexpr):
    """int64 keys ordered as (value, then lower index): the fp32 bits made order-preserving as a signed int
    (negative values' magnitude bits flipped; -0.0 read as +0.0) above, MAX_INDEX - index below."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (MAX_INDEX - index.to(tl.int64))


@triton.jit
def _topk_log_softmax_kernel(
    logits_ptr, to_target_ptr, values_ptr, ids_ptr, stride_row, vocab, k,
    BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, MAPPED: tl.constexpr,
    MAX_INDEX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    lowest = tl.full([BLOCK], -(2**63), tl.int64)
    row_max = 0.0
    log_sum = 0.0
    if ONE_BLOCK:
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        keys = _order_keys(x, offs, MAX_INDEX)  # past V: -inf at an index past V, below every entry
        if NORMALIZE:
            row_max = tl.max(x, 0)
            log_sum = tl.log(tl.sum(tl.exp(x - row_max), 0))
    elif NORMALIZE:  # per-lane online maximum and sum over the pieces, reduced once
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(lane_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(x - safe)
            lane_max = new_max
        row_max = tl.max(lane_max, 0)
        lane_sum = tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max))
        log_sum = tl.log(tl.sum(lane_sum, 0))
    previous = tl.full([], 2**63 - 1, tl.int64)  # above every key
    for r in range(k):
        if ONE_BLOCK:
            best = tl.max(tl.where(keys < previous, keys, lowest), 0)
        else:  # per-lane best over the pieces, reduced once
            lane_best = lowest
            for start in range(0, vocab, BLOCK):
                x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
                keys = _order_keys(x, start + offs, MAX_INDEX)
                lane_best = tl.maximum(lane_best, tl.where(keys < previous, keys, lowest))
            best = tl.max(lane_best, 0)
        previous = best
        key = (best >> 32).to(tl.int32)
        value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        index = MAX_INDEX - (best & MAX_INDEX)
        if NORMALIZE:
            value = value - row_max - log_sum
        if MAPPED:
            index = tl.load(to_target_ptr + index)
        tl.store(values_ptr + row * k + r, value)
        tl.store(ids_ptr + row * k + r, index)

"""The drafter's top-k candidates in one Triton launch (two for long rows): log-softmax, top-k and the id map.

A tree proposal ranks the drafter's vocabulary once per depth. In torch that is a softmax kernel (one block per
row), a radix top-k of six to eight launches and a gather through EAGLE-3's draft-to-target map: about ten small
kernels per depth at batch 1. Here one program per row computes, in fp32, the row's maximum and log-sum-exp, then
k rounds of argmax: round r takes the largest entry that ranks below round r - 1's pick. Entries are ranked by
value, then by the LOWER index first (torch.topk leaves the order of equal values unspecified on CUDA), through
one int64 key per entry (the value's order-preserving bits above, the index's complement below), so a round is
one max-reduction and needs no mask of the entries taken so far.

Rows up to ONE_BLOCK_VOCAB entries stay in registers of one program. Longer ones (DFlash and EAGLE-1 rank the
target's whole vocabulary) are split into CHUNK-wide pieces, one program each: a piece's own top k keys and its
maximum and sum of exponentials, then one program per row merges the pieces' keys and sums (two launches; one
program reading a 49k row k + 1 times took 60 us on an H100). Fixed output shapes, no host sync, nothing allocated
but the outputs and the pieces' small workspace: CUDA-graph capturable. Runs on GPUs, or on the CPU under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16  # the widest tree level (selection.draft_tree.MAX_TREE_TOP_K): each candidate is one more pass
ONE_BLOCK_VOCAB = 16384  # rows up to this many entries are loaded once
CHUNK = 4096  # entries per piece (and program) of a longer row
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
    mapped = to_target is not None
    if vocab <= ONE_BLOCK_VOCAB:
        block = triton.next_power_of_2(vocab)
        _topk_log_softmax_kernel[(rows,)](
            logits, ids if to_target is None else to_target, values, ids, logits.stride(0), vocab, k,
            BLOCK=block, NORMALIZE=normalize, MAPPED=mapped, MAX_INDEX=MAX_INDEX,
            num_warps=min(16, max(4, block // 1024)),
        )  # fmt: skip
        return values, ids
    pieces = triton.cdiv(vocab, CHUNK)
    piece_keys = torch.empty(rows, pieces, k, dtype=torch.int64, device=logits.device)
    piece_max = torch.empty(rows, pieces, dtype=torch.float32, device=logits.device)
    piece_sum = torch.empty(rows, pieces, dtype=torch.float32, device=logits.device)
    _topk_piece_kernel[(rows, pieces)](
        logits, piece_keys, piece_max, piece_sum, logits.stride(0), vocab, k,
        BLOCK=CHUNK, NORMALIZE=normalize, MAX_INDEX=MAX_INDEX, num_warps=4,
    )  # fmt: skip
    _topk_merge_kernel[(rows,)](
        piece_keys, piece_max, piece_sum, ids if to_target is None else to_target, values, ids, pieces, k,
        KEYS=triton.next_power_of_2(pieces * k), PIECES=triton.next_power_of_2(pieces), NORMALIZE=normalize,
        MAPPED=mapped, MAX_INDEX=MAX_INDEX, num_warps=4,
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
def _from_key(best, MAX_INDEX: tl.constexpr):
    """A key's value (fp32) and index."""
    key = (best >> 32).to(tl.int32)
    value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return value, MAX_INDEX - (best & MAX_INDEX)


@triton.jit
def _store_pick(value, index, r, row, to_target_ptr, values_ptr, ids_ptr, k, row_max, log_sum,
                NORMALIZE: tl.constexpr, MAPPED: tl.constexpr):  # fmt: skip
    if NORMALIZE:
        value = value - row_max - log_sum
    if MAPPED:
        index = tl.load(to_target_ptr + index)
    tl.store(values_ptr + row * k + r, value)
    tl.store(ids_ptr + row * k + r, index)


@triton.jit(do_not_specialize=["k"])  # each request's logprob count: one compile
def _topk_log_softmax_kernel(
    logits_ptr, to_target_ptr, values_ptr, ids_ptr, stride_row, vocab, k,
    BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, MAPPED: tl.constexpr, MAX_INDEX: tl.constexpr,
):  # fmt: skip
    """One row in registers: its log-sum-exp, then k rounds of the largest key below the last round's."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    keys = _order_keys(x, offs, MAX_INDEX)  # past V: -inf at an index past V, below every entry
    row_max = 0.0
    log_sum = 0.0
    if NORMALIZE:
        row_max = tl.max(x, 0)
        log_sum = tl.log(tl.sum(tl.exp(x - row_max), 0))
    lowest = tl.full([BLOCK], -(2**63), tl.int64)
    previous = tl.full([], 2**63 - 1, tl.int64)  # above every key
    for r in range(k):
        previous = tl.max(tl.where(keys < previous, keys, lowest), 0)
        value, index = _from_key(previous, MAX_INDEX)
        _store_pick(value, index, r, row, to_target_ptr, values_ptr, ids_ptr, k, row_max, log_sum, NORMALIZE, MAPPED)


@triton.jit(do_not_specialize=["k"])
def _topk_piece_kernel(
    logits_ptr, keys_ptr, max_ptr, sum_ptr, stride_row, vocab, k,
    BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, MAX_INDEX: tl.constexpr,
):  # fmt: skip
    """One piece of a long row: its top k keys (indices into the row) and its maximum and sum of exp(x - max)."""
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    keys = _order_keys(x, offs, MAX_INDEX)
    pieces = tl.num_programs(1)
    if NORMALIZE:
        piece_max = tl.max(x, 0)
        safe = tl.where(piece_max == float("-inf"), 0.0, piece_max)
        tl.store(max_ptr + row * pieces + piece, piece_max)
        tl.store(sum_ptr + row * pieces + piece, tl.sum(tl.exp(x - safe), 0))
    lowest = tl.full([BLOCK], -(2**63), tl.int64)
    previous = tl.full([], 2**63 - 1, tl.int64)
    for r in range(k):
        previous = tl.max(tl.where(keys < previous, keys, lowest), 0)
        tl.store(keys_ptr + (row * pieces + piece) * k + r, previous)


@triton.jit(do_not_specialize=["pieces", "k"])
def _topk_merge_kernel(
    keys_ptr, max_ptr, sum_ptr, to_target_ptr, values_ptr, ids_ptr, pieces, k,
    KEYS: tl.constexpr, PIECES: tl.constexpr, NORMALIZE: tl.constexpr, MAPPED: tl.constexpr,
    MAX_INDEX: tl.constexpr,
):  # fmt: skip
    """A long row's top k from its pieces' keys, and its log-sum-exp from the pieces' maxima and sums."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KEYS)
    lowest = tl.full([KEYS], -(2**63), tl.int64)
    keys = tl.load(keys_ptr + row * pieces * k + offs, mask=offs < pieces * k, other=0)
    keys = tl.where(offs < pieces * k, keys, lowest)
    row_max = 0.0
    log_sum = 0.0
    if NORMALIZE:
        each = tl.arange(0, PIECES)
        maxima = tl.load(max_ptr + row * pieces + each, mask=each < pieces, other=float("-inf"))
        sums = tl.load(sum_ptr + row * pieces + each, mask=each < pieces, other=0.0)
        row_max = tl.max(maxima, 0)
        scaled = tl.where(maxima == float("-inf"), 0.0, sums * tl.exp(maxima - row_max))
        log_sum = tl.log(tl.sum(scaled, 0))
    previous = tl.full([], 2**63 - 1, tl.int64)
    for r in range(k):
        previous = tl.max(tl.where(keys < previous, keys, lowest), 0)
        value, index = _from_key(previous, MAX_INDEX)
        _store_pick(value, index, r, row, to_target_ptr, values_ptr, ids_ptr, k, row_max, log_sum, NORMALIZE, MAPPED)

"""A DFlash dynamic tree from its block's candidates in one Triton launch (one program per request).

DFlashProposer drafts a dynamic tree from each block position's top_k candidates (tokens and log-probabilities,
[D, K]). In torch the tree costs about forty small kernels per step: per depth an expand, a sum and a top-k of the
K x K children (the K best go on), then the pool's parents, the verify_budget best of the pool, a sort and a search
to renumber the parents. At batch 1 on an H100 those launches cost more than the block pass itself. Here:

- the pool is a [D, K * K] register tile: level 0 holds position 0's K candidates, level d >= 1 the K x K
  children of level d - 1's frontier (child j: frontier node j // K, candidate j % K), scored by the sum of the
  log-probabilities along the path;
- a level's frontier is its K best children, best first (K rounds of a max over keys: the score's
  order-preserving bits above, the lower index below, as kernels/triton_topk.py ranks);
- the verified nodes are the verify_budget best of the pool by score less the depth tie-break (`tie_break`, per
  pool index, so a parent ranks above a child of equal score): budget rounds find the last key taken, and every
  key at or above it is taken;
- each taken node's place is the count of taken nodes before it in pool order (a prefix sum), and its parent's
  place is read back from a per-request scratch row after a barrier.

The same trees as the torch code (DFlashProposer.draft_tree) where no two candidates score the same; of equal
scores the lower pool index goes first (torch.topk's order among equals is unspecified on CUDA). Fixed shapes,
no host sync: CUDA-graph capturable. Runs on GPUs, or on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_topk import MAX_INDEX, _order_keys

MAX_TILE = 4096  # pool tile entries, depth x K^2 padded to powers of two: 16 x 256 at the selector's bounds


def dflash_dynamic_tree(
    log_probs: torch.Tensor, ids: torch.Tensor, tie_break: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's verified drafts from its block's candidates: `log_probs` (float32) and `ids` (int64), both
    [B, D, K], best first per position; `tie_break` (float32 [pool]) subtracted from each pool node's score before
    ranking. Returns tokens and parents (-1: the root), int64 [B, min(budget, pool)], in pool order (topological)."""
    count, depth, top_k = log_probs.shape
    pool = top_k + (depth - 1) * top_k * top_k
    if ids.shape != log_probs.shape or log_probs.dtype != torch.float32 or ids.dtype != torch.int64:
        raise ValueError(f"log_probs (float32) and ids (int64) must share [B, D, K], got {log_probs.shape} {ids.shape}")
    if tie_break.shape != (pool,) or tie_break.dtype != torch.float32:
        raise ValueError(f"tie_break must be float32 [pool = {pool}], got {tie_break.dtype} {tuple(tie_break.shape)}")
    depth_pad, level_pad = triton.next_power_of_2(depth), triton.next_power_of_2(top_k * top_k)
    if depth_pad * level_pad > MAX_TILE or budget < 1:
        raise ValueError(f"a tree of depth {depth}, top_k {top_k} and budget {budget} does not fit the kernel")
    kept = min(budget, pool)
    tokens = torch.empty(count, kept, dtype=torch.int64, device=ids.device)
    parents = torch.empty(count, kept, dtype=torch.int64, device=ids.device)
    if count == 0:
        return tokens, parents
    places = torch.empty(count, pool, dtype=torch.int64, device=ids.device)  # each pool node's place, read back
    _dynamic_tree_kernel[(count,)](
        log_probs.contiguous(), ids.contiguous(), tie_break, places, tokens, parents, pool, kept,
        DEPTH=depth, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), DEPTH_PAD=depth_pad, LEVEL_PAD=level_pad,
        MAX_INDEX=MAX_INDEX, num_warps=4 if depth_pad * level_pad <= 1024 else 8,
    )  # fmt: skip
    return tokens, parents


@triton.jit
def _dynamic_tree_kernel(
    log_probs_ptr, ids_ptr, tie_ptr, places_ptr, tokens_ptr, parents_ptr, pool, kept,
    DEPTH: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, DEPTH_PAD: tl.constexpr,
    LEVEL_PAD: tl.constexpr, MAX_INDEX: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0).to(tl.int64)
    candidates = log_probs_ptr + request * DEPTH * TOP_K  # [D, K] of this request
    token_ids = ids_ptr + request * DEPTH * TOP_K
    level = tl.arange(0, DEPTH_PAD)[:, None]
    child = tl.arange(0, LEVEL_PAD)[None, :]
    in_pool = ((level == 0) & (child < TOP_K)) | ((level >= 1) & (level < DEPTH) & (child < TOP_K * TOP_K))
    pool_index = tl.where(level == 0, child, TOP_K + (level - 1) * TOP_K * TOP_K + child)

    # Level 0: position 0's candidates, children of the root; its frontier is all of them, in their order.
    kids = tl.arange(0, LEVEL_PAD)  # a level's nodes
    level_scores = tl.load(candidates + kids, mask=kids < TOP_K, other=float("-inf"))
    scores = tl.where(level == 0, level_scores[None, :], float("-inf"))
    tokens = tl.where(level == 0, tl.load(token_ids + kids, mask=kids < TOP_K, other=0)[None, :], 0)
    parents = tl.full([DEPTH_PAD, LEVEL_PAD], -1, tl.int64)
    slot = tl.arange(0, K_PAD)
    frontier_scores = tl.load(candidates + slot, mask=slot < TOP_K, other=float("-inf"))
    frontier_nodes = slot.to(tl.int64)  # pool indices of the nodes expanded next

    of_parent = (kids // TOP_K)[:, None] == slot[None, :]  # [children, frontier]: child j's expanded node
    lowest = tl.full([LEVEL_PAD], -(2**63), tl.int64)
    for d in tl.static_range(1, DEPTH):
        real = kids < TOP_K * TOP_K
        own = tl.load(candidates + d * TOP_K + kids % TOP_K, mask=real, other=float("-inf"))
        level_scores = tl.max(tl.where(of_parent, frontier_scores[None, :], float("-inf")), 1) + own
        level_scores = tl.where(real, level_scores, float("-inf"))
        level_parents = tl.max(tl.where(of_parent, frontier_nodes[None, :], -1), 1)
        level_tokens = tl.load(token_ids + d * TOP_K + kids % TOP_K, mask=real, other=0)
        scores = tl.where(level == d, level_scores[None, :], scores)
        tokens = tl.where(level == d, level_tokens[None, :], tokens)
        parents = tl.where(level == d, level_parents[None, :], parents)
        if d < DEPTH - 1:  # the level's K best children go on, best first
            keys = tl.where(real, _order_keys(level_scores, kids, MAX_INDEX), lowest)
            previous = tl.full([], 2**63 - 1, tl.int64)
            for r in range(TOP_K):
                previous = tl.max(tl.where(keys < previous, keys, lowest), 0)
                best = MAX_INDEX - (previous & MAX_INDEX)
                score = tl.max(tl.where(kids == best, level_scores, float("-inf")), 0)
                frontier_scores = tl.where(slot == r, score, frontier_scores)
                frontier_nodes = tl.where(slot == r, TOP_K + (d - 1) * TOP_K * TOP_K + best, frontier_nodes)

    # The verify_budget best of the pool: every key at or above the kept-th largest.
    tie = tl.load(tie_ptr + pool_index, mask=in_pool, other=0.0)
    none = tl.full([DEPTH_PAD, LEVEL_PAD], -(2**63), tl.int64)
    keys = tl.where(in_pool, _order_keys(scores - tie, pool_index, MAX_INDEX), none)
    previous = tl.full([], 2**63 - 1, tl.int64)
    for _ in range(kept):
        previous = tl.max(tl.max(tl.where(keys < previous, keys, none), 1), 0)
    taken = (keys >= previous) & in_pool
    # Places in pool order (row-major over the tile): taken nodes before this one, itself included, less one.
    counts = taken.to(tl.int64)
    per_level = tl.sum(counts, 1)
    places = (tl.cumsum(per_level, 0) - per_level)[:, None] + tl.cumsum(counts, 1) - 1
    tl.store(places_ptr + request * pool + pool_index, places, mask=in_pool)
    tl.debug_barrier()  # every place stored before a parent's is read
    parent_places = tl.load(places_ptr + request * pool + parents, mask=taken & (parents >= 0), other=-1)
    tl.store(tokens_ptr + request * kept + places, tokens, mask=taken)
    tl.store(parents_ptr + request * kept + places, parent_places, mask=taken)

"""Tree attention masks: which of its request's newest keys each query token sees.

Tree drafting verifies a tree of drafts in one pass (and drafts it in passes over several candidates per
request): a draft must see the context and its ancestors, not its siblings and cousins that precede it in
the flattened order. Neither a causal nor a bidirectional mask says that, so the mask comes per token:

    tree_mask [T] int64, one per query token. For a request with S keys, key p is visible to its query
    token i iff the causal rule allows it (p <= context + i, bottom-right aligned) and either p < S - 64
    (the older keys: context) or bit p - (S - 64) of tree_mask[i] is set (the 64 newest keys).
    -1 (every bit set) is plain causal attention, so one batch mixes tree requests and prefill chunks.

Bits count from the window's start, S - 64, so that a tree whose tokens are the request's last keys gets
the same bits whatever the context length. A tree has at most TREE_WINDOW tokens (root included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the selector imports kernels without torch; only the tensor helper below uses it
    import torch

TREE_WINDOW = 64
CAUSAL = -1  # the mask of a token that attends causally


def to_int64(bits: int) -> int:
    """An unsigned 64-bit pattern as the signed value an int64 tensor holds."""
    bits &= (1 << TREE_WINDOW) - 1
    return bits - (1 << TREE_WINDOW) if bits >> (TREE_WINDOW - 1) else bits


def tree_masks(parents: list[int]) -> list[int]:
    """The masks of a request's last len(parents) query tokens, a tree in topological order: parents[j] is
    the query index of token j's parent, -1 for a token whose parent is the context (the root). Each sees
    the context, its ancestors and itself."""
    count = len(parents)
    if count > TREE_WINDOW:
        raise ValueError(f"a tree of {count} tokens does not fit the {TREE_WINDOW}-key mask window")
    first = TREE_WINDOW - count  # window bit of query 0
    context = (1 << first) - 1
    own: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"token {j}'s parent {parent} must precede it (topological order)")
        own.append((own[parent] if parent >= 0 else context) | (1 << (first + j)))
    return [to_int64(bits) for bits in own]


def ancestor_bits(parents: list[int]) -> list[int]:
    """Per token, the set of its ancestors and itself as bits over token indices (bit j: token j)."""
    bits: list[int] = []
    for j, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << j))
    return bits


def window_visible(tree_mask: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | int) -> torch.Tensor:
    """The window rule on tensors: whether keys at `positions` of requests with `seq_lens` keys pass the
    tree masks `tree_mask` (broadcast together). The causal rule is the caller's."""
    offset = positions - (seq_lens - TREE_WINDOW)
    bits = (tree_mask >> offset.clamp(0, TREE_WINDOW - 1)) & 1
    return (offset < 0) | (bits != 0)

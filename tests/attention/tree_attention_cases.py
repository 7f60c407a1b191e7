"""Tree-attention batches and their dense reference, shared by test_tree_attention.py and test_split_combine.py:
random trees mixed with plain causal requests, and float64 SDPA with a mask built by walking each draft's
parents (not from the kernels' bitmasks)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kernels.testing import BatchSpec, PagedBatch, make_paged_batch
from kernels.tree_mask import CAUSAL, TREE_WINDOW, tree_masks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_tree(size: int, rng: random.Random) -> list[int]:
    """Parents of `size` query tokens in topological order: token 0 is the root (the last verified token),
    every other token hangs below an earlier one; at least two tokens share a parent (not a chain)."""
    parents = [-1] + [rng.randrange(j) for j in range(1, size)]
    if size > 2:
        parents[2] = parents[1]  # siblings: a causal mask would let token 2 see token 1
    return parents


def tree_case(seed: int) -> tuple[BatchSpec, list[list[int] | None]]:
    """A batch of tree requests (contexts below and above the window) and causal ones (None)."""
    rng = random.Random(seed)
    trees: list[list[int] | None] = [
        random_tree(16, rng),
        None,
        random_tree(TREE_WINDOW, rng),
        random_tree(5, rng),
        None,
        random_tree(1, rng),
    ]
    contexts = [3, 20, 90, 130, 0, 40]
    query_lens = [len(t) if t is not None else n for t, n in zip(trees, [1, 7, 1, 1, 24, 1], strict=True)]
    spec = BatchSpec(f"tree{seed}", tuple(c + q for c, q in zip(contexts, query_lens, strict=True)), tuple(query_lens))
    return spec, trees


def masks_tensor(trees: list[list[int] | None], spec: BatchSpec, device: torch.device) -> torch.Tensor:
    values: list[int] = []
    for tree, query_len in zip(trees, spec.query_lens, strict=True):
        values += tree_masks(tree) if tree is not None else [CAUSAL] * query_len
    return torch.tensor(values, dtype=torch.int64, device=device)


def dense_reference(batch: PagedBatch, trees: list[list[int] | None], scale: float) -> torch.Tensor:
    """Float64 SDPA per request with a boolean mask: the context, then each draft's chain of parents."""
    q = batch.q.double().cpu()
    group = q.shape[1] // batch.keys[0].shape[1]
    out, start = torch.empty_like(q), 0
    for keys, values, tree, query_len in zip(batch.keys, batch.values, trees, batch.spec.query_lens, strict=True):
        seq_len = keys.shape[0]
        context = seq_len - query_len
        mask = torch.zeros(query_len, seq_len, dtype=torch.bool)
        mask[:, :context] = True
        for i in range(query_len):
            if tree is None:
                mask[i, context : context + i + 1] = True
                continue
            node = i
            while node >= 0:  # itself and every ancestor
                mask[i, context + node] = True
                node = tree[node]
        result = F.scaled_dot_product_attention(
            q[start : start + query_len].transpose(0, 1),
            keys.double().repeat_interleave(group, 1).transpose(0, 1),
            values.double().repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[start : start + query_len] = result.transpose(0, 1)
        start += query_len
    return out


def tree_batch(seed: int, block_size: int = 16, dtype: torch.dtype = torch.float32):
    spec, trees = tree_case(seed)
    batch = make_paged_batch(spec, 4, 2, 32, block_size, dtype, DEVICE, seed=seed)
    return batch, trees, masks_tensor(trees, spec, DEVICE)

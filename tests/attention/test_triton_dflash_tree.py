"""The fused DFlash dynamic-tree kernel (kernels/triton_dflash_tree.py) under the interpreter on the CPU (or
compiled on the GPU) against a plain reference written from the rule: expand each level's top_k best children
(best first, equal scores lowest index first), verify the budget best of the pool by score less the depth
tie-break (equal keys: lowest pool index first), list them in pool order with parents renumbered."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_dflash_tree import dflash_dynamic_tree

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIE = 1e-6


def tie_break(depth: int, top_k: int) -> torch.Tensor:
    sizes = [top_k] + [top_k * top_k] * (depth - 1)
    return torch.cat([torch.full((size,), d) for d, size in enumerate(sizes)]).mul(TIE).float()


def reference(log_probs: torch.Tensor, ids: torch.Tensor, budget: int) -> tuple[list[int], list[int]]:
    """One request: [D, K] candidates -> (tokens, parents) of the verified tree."""
    depth, top_k = log_probs.shape
    scores, tokens, parents = list(log_probs[0]), list(ids[0].tolist()), [-1] * top_k
    frontier = list(range(top_k))  # pool indices of the nodes expanded next
    start = 0
    for d in range(1, depth):
        start = top_k + (d - 1) * top_k * top_k
        level = []
        for j in range(top_k * top_k):
            parent = frontier[j // top_k]
            level.append(scores[parent] + log_probs[d, j % top_k])
            tokens.append(int(ids[d, j % top_k]))
            parents.append(parent)
        scores += level
        order = sorted(range(len(level)), key=lambda j: (-float(level[j]), j))
        frontier = [start + j for j in order[:top_k]]
    ties = tie_break(depth, top_k)
    ranked = sorted(range(len(scores)), key=lambda i: (-float(scores[i] - ties[i]), i))
    chosen = sorted(ranked[:budget])
    place = {node: i for i, node in enumerate(chosen)}
    return [tokens[i] for i in chosen], [-1 if parents[i] < 0 else place[parents[i]] for i in chosen]


def candidates(count: int, depth: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(count * depth, 200, generator=generator).mul(2)
    log_probs, ids = logits.log_softmax(-1).topk(top_k, dim=-1)
    return log_probs.view(count, depth, top_k), ids.view(count, depth, top_k)


def run(log_probs: torch.Tensor, ids: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    depth, top_k = log_probs.shape[1:]
    tokens, parents = dflash_dynamic_tree(
        log_probs.to(DEVICE), ids.to(DEVICE), tie_break(depth, top_k).to(DEVICE), budget
    )
    return tokens.cpu(), parents.cpu()


@pytest.mark.parametrize(("depth", "top_k", "budget"), [(2, 2, 3), (4, 3, 8), (7, 8, 16), (10, 6, 32), (3, 5, 200)])
def test_random_candidates_match_the_reference(depth: int, top_k: int, budget: int) -> None:
    log_probs, ids = candidates(3, depth, top_k, seed=depth * 100 + top_k)
    tokens, parents = run(log_probs, ids, budget)
    kept = min(budget, top_k + (depth - 1) * top_k * top_k)
    assert tokens.shape == parents.shape == (3, kept) and tokens.dtype == parents.dtype == torch.int64
    for request in range(3):
        expected = reference(log_probs[request], ids[request], budget)
        assert (tokens[request].tolist(), parents[request].tolist()) == expected


def test_certain_candidates_keep_their_parents() -> None:
    """Log-probability 0 (a saturated softmax) makes a child score as its parent: the tie-break keeps the parent
    first, and every verified node's parent is verified before it."""
    log_probs, ids = candidates(2, 5, 3, seed=7)
    log_probs[:, :, 0] = 0.0
    tokens, parents = run(log_probs, ids, 9)
    for request in range(2):
        assert (tokens[request].tolist(), parents[request].tolist()) == reference(log_probs[request], ids[request], 9)
        assert all(-1 <= p < i for i, p in enumerate(parents[request].tolist()))
        depths: list[int] = []
        for parent in parents[request].tolist():
            depths.append(0 if parent < 0 else depths[parent] + 1)
        assert max(depths) == 4  # the all-certain path is verified to the last depth


def test_bad_arguments_are_refused() -> None:
    log_probs, ids = candidates(1, 3, 2, seed=1)
    with pytest.raises(ValueError, match="share"):
        dflash_dynamic_tree(log_probs, ids.int(), tie_break(3, 2), 4)
    with pytest.raises(ValueError, match="tie_break"):
        dflash_dynamic_tree(log_probs, ids, tie_break(2, 2), 4)
    with pytest.raises(ValueError, match="does not fit"):
        dflash_dynamic_tree(log_probs, ids, tie_break(3, 2), 0)

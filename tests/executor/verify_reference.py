"""A plain-Python reference of the greedy rule, for the verifier's tests: from the root, follow the first child
that is the target's argmax at its parent's row; then the argmax at the path's last row. Also the broken parts
of the verifier that the distribution tests' negative controls patch in."""

from __future__ import annotations

import torch

from executor_service.spec_decode.verifier import DraftLayout


def without_residual(layout: DraftLayout, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """In place of verifier._rejected_mass: right acceptance test, wrong correction (nothing of the rejected
    drafts removed: the final token from p, not norm(max(0, p - q))), so drafted tokens come out too often."""
    return layout.tokens, torch.zeros(layout.tokens.shape, device=layout.tokens.device)


def accepts_all(logprobs: torch.Tensor, layout: DraftLayout, *_: object) -> torch.Tensor:
    """In place of verifier._sampled_hits: every draft hits, so the drafter's choices leak through."""
    return torch.ones_like(layout.tokens, dtype=torch.bool)


def rejects_all(logprobs: torch.Tensor, layout: DraftLayout, *_: object) -> torch.Tensor:
    """In place of verifier._sampled_hits: every draft misses."""
    return torch.zeros_like(layout.tokens, dtype=torch.bool)


def greedy_walk(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """(the accepted drafts, root's child first; their tokens, then the target's next token) of one request's
    drafts (parents -1: the root) and the target's argmax at each of its rows (row 0: the root)."""
    path, row = [], 0
    while True:
        match = next((j for j, p in enumerate(parents) if p + 1 == row and tokens[j] == argmax[row]), None)
        if match is None:
            return path, [tokens[j] for j in path] + [argmax[row]]
        path.append(match)
        row = match + 1

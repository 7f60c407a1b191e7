"""A plain-Python reference of the greedy rule, for the verifier's tests: from the root, follow the first child
that is the target's argmax at its parent's row; then the argmax at the path's last row. Also the broken parts
of the verifier that the distribution tests' negative controls patch in."""

from __future__ import annotations

import torch

from executor_service.spec_decode.verifier import DraftLayout


def without_residual(layout: DraftLayout, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """In place of verifier._rejected_q: right acceptance test, wrong correction (nothing of the rejected draft's q
    removed: the final token from p, not norm(max(0, p - q))), so drafted tokens come out too often."""
    return layout.tokens, torch.zeros(layout.tokens.shape, device=layout.tokens.device)


def accepts_all(target: torch.Tensor, layout: DraftLayout, *_: object) -> torch.Tensor:
    """In place of verifier._greedy_hits or _q_hits: every draft hits, so the drafter's choices leak through."""
    return torch.ones_like(layout.tokens, dtype=torch.bool)


def independent_hits(row_tokens: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """In place of verifier._greedy_hits: drafts tested against another request's draws (the batch rolled by one),
    not the draws that are emitted: an acceptance test and a token that do not share their random numbers."""
    rolled = row_tokens.roll(1, dims=0)
    return layout.tokens == (rolled[:, :-1] if layout.chain else rolled.gather(1, layout.parents + 1))


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

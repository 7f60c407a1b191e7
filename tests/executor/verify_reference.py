"""A plain-Python reference of the greedy rule, for the verifier's tests: from the root, follow the first child
that is the target's argmax at its parent's row; then the argmax at the path's last row."""

from __future__ import annotations


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

"""sample_tree on its own: the emitted tokens follow the target's rows exactly (counted over many seeded walks of
small trees, repeated siblings included), a residual that rounding left empty falls back to the row itself, and a
final row that is not a distribution fails the request with VerifyError."""

from __future__ import annotations

import pytest
import torch

from executor_service.rejection_sampler import VerifyError
from executor_service.tree_verification import DraftTree, _final_token, sample_tree

WALKS = 20_000
TOLERANCE = 0.015  # about 5 standard deviations of a frequency near 0.5 over WALKS walks


def frequencies(tree: DraftTree, probs: torch.Tensor, position: int, after: list[int]) -> torch.Tensor:
    """How often each token is emitted at `position`, among the walks that emitted `after` before it."""
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(probs.shape[1])
    for _ in range(WALKS):
        emitted = sample_tree(tree, probs, generator).emitted
        if len(emitted) > position and emitted[:position] == after:
            counts[emitted[position]] += 1
    return counts / counts.sum()


ROWS = torch.tensor(
    [
        [0.5, 0.3, 0.2, 0.0],  # the root's row
        [0.1, 0.1, 0.4, 0.4],  # after draft 0 (token 0)
        [0.25, 0.25, 0.25, 0.25],  # after draft 1 (token 1)
        [0.7, 0.1, 0.1, 0.1],  # after draft 2 (token 2, a child of draft 0)
    ]
)


@pytest.mark.parametrize(
    ("tokens", "parents"),
    [([0, 1, 2], [-1, -1, 0]), ([1, 1, 2], [-1, -1, 1])],
    ids=["two children, one grandchild", "a repeated sibling"],
)
def test_emitted_tokens_follow_the_target_rows(tokens: list[int], parents: list[int]) -> None:
    tree = DraftTree(tokens, parents)
    first = frequencies(tree, ROWS, 0, [])
    assert torch.allclose(first, ROWS[0], atol=TOLERANCE), first
    second = frequencies(tree, ROWS, 1, [tokens[0]])  # after the first draft's token: that draft's row
    assert torch.allclose(second, ROWS[1], atol=TOLERANCE), second


def test_an_empty_residual_falls_back_to_the_row() -> None:
    row = torch.tensor([0.6, 0.4, 0.0])
    drawn = {_final_token(row, [0, 1], torch.Generator().manual_seed(seed)) for seed in range(40)}
    assert drawn == {0, 1}


def test_a_row_that_is_not_a_distribution_fails() -> None:
    """The final token's row is checked where it is drawn (rows with non-finite logits fail before the walk)."""
    probs = ROWS.clone()
    probs[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # draft 0 (token 0) is accepted for sure
    probs[1, 3] = float("nan")  # its row, which the bonus token is drawn from
    with pytest.raises(VerifyError, match="not a distribution"):
        sample_tree(DraftTree([0, 1], [-1, -1]), probs, torch.Generator().manual_seed(1))

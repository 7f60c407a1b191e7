"""Trees on the host path (host_verify.verify_on_host, the verifier's multi-candidate rule): the emitted tokens
follow the target's rows exactly (counted over many seeded requests of small trees, repeated siblings included),
and a request whose logits are not finite fails alone."""

from __future__ import annotations

import pytest
import torch
from host_verify_runs import request_of

from executor_service.sample.sampling import SamplingSettings
from executor_service.spec_decode.host_verify import DraftTree, TreeVerdict, VerifyError, verify_on_host

REQUESTS = 20_000
TOLERANCE = 0.015  # about 5 standard deviations of a frequency near 0.5 over REQUESTS requests
SAMPLED = SamplingSettings(temperature=1.0)

ROWS = torch.tensor(
    [
        [0.5, 0.3, 0.2, 0.0],  # the root's row
        [0.1, 0.1, 0.4, 0.4],  # after draft 0 (token 0)
        [0.25, 0.25, 0.25, 0.25],  # after draft 1 (token 1)
        [0.7, 0.1, 0.1, 0.1],  # after draft 2 (token 2, a child of draft 0)
    ]
)


def verdicts(tree: DraftTree, rows: torch.Tensor, count: int) -> list[TreeVerdict]:
    """`count` requests with the same tree and rows of probabilities, each with its own seed, in one batch."""
    requests = [request_of(SAMPLED, seed) for seed in range(count)]
    found = verify_on_host(rows.log().repeat(count, 1), requests, [tree] * count)
    assert all(isinstance(v, TreeVerdict) for v in found)
    return [v for v in found if isinstance(v, TreeVerdict)]


def frequencies(found: list[TreeVerdict], position: int, after: list[int]) -> torch.Tensor:
    """How often each token is emitted at `position`, among the requests that emitted `after` before it."""
    counts = torch.zeros(ROWS.shape[1])
    for verdict in found:
        if len(verdict.emitted) > position and verdict.emitted[:position] == after:
            counts[verdict.emitted[position]] += 1
    return counts / counts.sum()


@pytest.mark.parametrize(
    ("tokens", "parents"),
    [([0, 1, 2], [-1, -1, 0]), ([1, 1, 2], [-1, -1, 1])],
    ids=["two children, one grandchild", "a repeated sibling"],
)
def test_emitted_tokens_follow_the_target_rows(tokens: list[int], parents: list[int]) -> None:
    found = verdicts(DraftTree(tokens, parents), ROWS, REQUESTS)
    first = frequencies(found, 0, [])
    assert torch.allclose(first, ROWS[0], atol=TOLERANCE), first
    second = frequencies(found, 1, [tokens[0]])  # after the first draft's token: that draft's row
    assert torch.allclose(second, ROWS[1], atol=TOLERANCE), second
    for verdict in found:  # the path is the emitted drafts'
        assert [tokens[j] for j in verdict.path] == verdict.emitted[: len(verdict.path)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_request_whose_logits_are_not_finite_fails_alone(bad: float) -> None:
    """Also beside a request whose drafts are outside the vocabulary (verified as its root alone)."""
    tree = DraftTree([0, 1], [-1, -1])
    logits = ROWS[:3].log().repeat(3, 1)
    logits[4, 2] = bad  # the second request's draft 0 row
    requests = [request_of(SAMPLED, seed) for seed in range(3)] + [request_of(SamplingSettings(), 0)]
    trees = [tree, tree, DraftTree([1, 9], [-1, 0]), tree]
    found = verify_on_host(torch.cat([logits, ROWS[:3].log()]), requests, trees)
    assert isinstance(found[1], VerifyError) and "not finite" in str(found[1])
    assert isinstance(found[2], VerifyError) and "outside the vocabulary" in str(found[2])
    assert isinstance(found[0], TreeVerdict) and isinstance(found[3], TreeVerdict)
    assert found[3].emitted[0] == 0  # greedy: the root row's argmax

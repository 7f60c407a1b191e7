"""The rejection sampler keeps the target's distribution exactly: a statistical test over many draws on a
small vocabulary, with a bound that a wrong sampler (shown alongside) fails."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_service.rejection_sampler import rejection_sample

VOCAB = 6
TRIALS = 12000
BOUND = 0.025  # total variation; sampling noise at this many trials is ~0.01


def distributions(seed: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, VOCAB, generator=generator), dim=-1)


def emitted_distribution(
    sampler: Callable[..., list[int]], target: torch.Tensor, draft: torch.Tensor | None, num_drafts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empirical distributions of the first and the second emitted token over TRIALS draws."""
    generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    seconds = 0
    for _ in range(TRIALS):
        if draft is None:  # a greedy drafter: its argmax, as a point mass
            drafts = target[:num_drafts].roll(1, dims=-1).argmax(-1)
        else:
            drafts = torch.multinomial(draft[:num_drafts], 1, generator=generator)[:, 0]
        tokens = sampler(drafts, draft[:num_drafts] if draft is not None else None, target, generator)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
            seconds += 1
    return first / TRIALS, second / max(seconds, 1)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def always_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Accepts every draft: the drafter's distribution leaks through."""
    return [*drafts.tolist(), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))]


def resample_from_target(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Right acceptance test, wrong correction (p instead of norm(max(0, p - q))): biased."""
    k = len(drafts)
    q = draft_probs[torch.arange(k), drafts] if draft_probs is not None else torch.ones(k)
    p = target_probs[torch.arange(k), drafts]
    for i in range(k):
        if float(torch.rand((), generator=generator)) * float(q[i]) > float(p[i]):
            return [*drafts[:i].tolist(), int(torch.multinomial(target_probs[i], 1, generator=generator))]
    return [*drafts.tolist(), int(torch.multinomial(target_probs[k], 1, generator=generator))]


@pytest.mark.parametrize("num_drafts", [1, 3])
@pytest.mark.parametrize("drafter", ["sampled", "point-mass"])
def test_emitted_tokens_follow_the_target_distribution(num_drafts: int, drafter: str) -> None:
    target = distributions(1, num_drafts + 1)
    draft = distributions(2, num_drafts) if drafter == "sampled" else None
    first, second = emitted_distribution(rejection_sample, target, draft, num_drafts)
    assert total_variation(first, target[0]) < BOUND
    if num_drafts > 1:  # the second token, given a first was accepted, follows p_2
        assert total_variation(second, target[1]) < BOUND


@pytest.mark.parametrize("broken", [always_accept, resample_from_target])
def test_the_bound_catches_a_wrong_sampler(broken: Callable[..., list[int]]) -> None:
    target, draft = distributions(1, 2), distributions(2, 1)
    first, _ = emitted_distribution(broken, target, draft, 1)
    assert total_variation(first, target[0]) > BOUND


def test_full_and_partial_acceptance() -> None:
    target = torch.eye(VOCAB)[[2, 4, 1, 3]]  # the target is certain: tokens 2, 4, 1, then 3
    assert rejection_sample(torch.tensor([2, 4, 1]), None, target) == [2, 4, 1, 3]
    assert rejection_sample(torch.tensor([2, 5, 1]), None, target) == [2, 4]

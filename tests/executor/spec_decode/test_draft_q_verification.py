"""The verifier's rule for a chain's drafts drawn from the drafter's q (verifier.DraftQ): the emitted tokens
follow the target's distribution exactly, first and second token, over many seeded requests on a small vocabulary,
with a bound that a wrong residual and accepting every draft (shown alongside) fail; a point mass q is the
point-mass rule bit for bit; a tree refuses q."""

from __future__ import annotations

import pytest
import torch
from host_verify_runs import request_of
from verify_reference import accepts_all, without_residual

from executor_service.sample.device_sampling import SamplingTensors, StepKeys
from executor_service.sample.sampling import DraftProbs, SamplingSettings
from executor_service.spec_decode import verifier
from executor_service.spec_decode.host_verify import TreeVerdict, verify_on_host
from executor_service.spec_decode.verifier import DraftLayout, DraftQ, tree_layout, verify

VOCAB = 6
COUNT = 12_000
BOUND = 0.025  # total variation; sampling noise at this many requests is ~0.01
CPU = torch.device("cpu")


def distributions(seed: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, VOCAB, generator=generator), dim=-1)


def chain(tokens: torch.Tensor) -> DraftLayout:
    count, num = tokens.shape
    return DraftLayout(tokens, (torch.arange(num) - 1).expand(count, -1), None, None, num, chain=True)


def verified(target: torch.Tensor, q: torch.Tensor | None, settings: SamplingSettings) -> verifier.Verdict:
    """COUNT requests with the same rows `target` [k + 1, V] and their own seeds; drafts drawn from q [k, V] (None:
    the point masses of a greedy drafter's favourites, not the target's)."""
    num = target.shape[0] - 1
    if q is None:
        tokens = target[:num].roll(1, dims=-1).argmax(-1).expand(COUNT, num)
    else:
        tokens = torch.multinomial(q, COUNT, replacement=True, generator=torch.Generator().manual_seed(0)).T
    sampling = SamplingTensors.build([settings] * COUNT, list(range(COUNT)), CPU)
    found = None if q is None else DraftQ(torch.arange(VOCAB).expand(COUNT, num, VOCAB), q.expand(COUNT, num, VOCAB))
    logits = target.log().repeat(COUNT, 1)
    return verify(
        logits,
        chain(tokens.contiguous()),
        sampling,
        StepKeys.on_device(sampling.seed, torch.full((COUNT,), 9), num, q_drafts=found is not None),
        q=found,
    )


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    found = torch.bincount(samples, minlength=VOCAB).double() / samples.shape[0]
    return 0.5 * (found - probs.double()).abs().sum().item()


def distances(num_drafts: int, drafter: str) -> tuple[float, float, int]:
    """Total variation of the first emitted token against p_0, and of the second (where the first draft was
    accepted) against p_1; and how many requests emitted a second token."""
    target = distributions(1, num_drafts + 1)
    q = distributions(2, num_drafts) if drafter == "sampled" else None
    verdict = verified(target, q, SamplingSettings(temperature=1.0))
    second = verdict.emitted[verdict.accepted >= 1, 1]
    return total_variation(verdict.emitted[:, 0], target[0]), total_variation(second, target[1]), second.shape[0]


@pytest.mark.parametrize("num_drafts", [1, 3])
@pytest.mark.parametrize("drafter", ["sampled", "point-mass"])
def test_emitted_tokens_follow_the_target_distribution(num_drafts: int, drafter: str) -> None:
    first, second, seconds = distances(num_drafts, drafter)
    assert COUNT // 10 < seconds < COUNT * 0.9  # both paths ran, many times
    assert first < BOUND, first
    assert second < 2 * BOUND, second  # fewer samples; with one draft: the bonus row, p_1 too


def test_the_bound_catches_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right acceptance test, wrong correction: p instead of norm(max(0, p - q))."""
    monkeypatch.setattr(verifier, "_rejected_q", without_residual)
    assert distances(3, "sampled")[0] > BOUND


def test_the_bound_catches_accept_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifier, "_q_hits", accepts_all)
    assert distances(3, "sampled")[0] > BOUND


def test_a_drafter_that_knows_the_target_has_every_draft_accepted() -> None:
    """q == p: every draft passes u * q < p, where point masses accept each draft with p(d) only."""
    target = distributions(3, 4)
    assert verified(target, target[:3], SamplingSettings(temperature=1.0)).accepted.tolist() == [3] * COUNT
    assert verified(target, None, SamplingSettings(temperature=1.0)).accepted.float().mean() < 2.0


def test_a_point_mass_q_is_verified_as_one_built_for_a_request_without_q() -> None:
    """A batch of greedy and sampled requests (top-k, top-p too): q one-hot at each draft given as DraftProbs gives
    the verdict of the one-hot rows DraftQ.build makes for requests without q (a batch mixing them verifies both
    by the q rule), and through the host path as well."""
    generator = torch.Generator().manual_seed(4)
    count, num, vocab = 64, 4, 50
    logits = torch.randn(count * (num + 1), vocab, generator=generator) * 2
    tokens = torch.randint(0, 3, (count, num), generator=generator)  # often the argmax's neighbours: both paths
    settings = [[SamplingSettings(), SamplingSettings(0.9), SamplingSettings(1.2, top_k=5, top_p=0.8)][i % 3]
                for i in range(count)]  # fmt: skip
    sampling = SamplingTensors.build(settings, [7 * i for i in range(count)], CPU)
    keys = StepKeys.on_device(sampling.seed, torch.arange(count) + 30, num, q_drafts=True)
    one_hot = [DraftProbs(tokens[i][:, None], torch.ones(num, 1)) for i in range(count)]
    built = verify(logits, chain(tokens), sampling, keys, True, q=DraftQ.build(tokens, [None] * count))
    given = verify(logits, chain(tokens), sampling, keys, True, q=DraftQ.build(tokens, one_hot))
    assert torch.equal(given.accepted, built.accepted) and torch.equal(given.emitted, built.emitted)
    assert 0 < int(built.accepted.sum()) < count * num
    requests = [request_of(s, 7 * i) for i, s in enumerate(settings)]
    drafts = tokens.tolist()
    half = [q if i % 2 else None for i, q in enumerate(one_hot)]
    assert verify_on_host(logits, requests, drafts, one_hot) == verify_on_host(logits, requests, drafts, half)


def test_a_tree_refuses_q() -> None:
    parents = torch.tensor([[-1, -1, 0]])
    node_depth, ancestors = tree_layout(parents, 2)
    layout = DraftLayout(torch.tensor([[1, 2, 3]]), parents, node_depth, ancestors, 2)
    sampling = SamplingTensors.build([SamplingSettings(1.0)], [1], CPU)
    q = DraftQ.build(layout.tokens, [None])
    with pytest.raises(ValueError, match="chain"):
        verify(
            torch.randn(4, VOCAB),
            layout,
            sampling,
            StepKeys.on_device(sampling.seed, torch.zeros(1, dtype=torch.int64), 2, q_drafts=True),
            q=q,
        )


def test_full_and_partial_acceptance() -> None:
    """The target is certain (tokens 2, 4, 1, then 3): drafts drawn from a uniform q are kept while they agree."""
    logits = torch.full((4, VOCAB), -30.0)
    logits[torch.arange(4), torch.tensor([2, 4, 1, 3])] = 0.0
    uniform = DraftProbs(torch.arange(VOCAB).expand(3, VOCAB), torch.full((3, VOCAB), 1.0 / VOCAB))
    settings = SamplingSettings(temperature=1.0)
    found = verify_on_host(logits, [request_of(settings, 1)], [[2, 4, 1]], [uniform])
    assert found == [TreeVerdict([0, 1, 2], [2, 4, 1, 3])]
    found = verify_on_host(logits, [request_of(settings, 1)], [[2, 5, 1]], [uniform])
    assert found == [TreeVerdict([0], [2, 4])]

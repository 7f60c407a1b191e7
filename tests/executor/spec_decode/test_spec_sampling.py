"""Speculative sampling through the whole engine keeps the target's distribution: many seeded requests
on a 6-token vocabulary, their emitted tokens against the exact marginals of the dense target (every
continuation enumerated), with a total-variation bound that a wrong verification (shown alongside) fails.

With k = 3 and max_tokens = 4, token 1 comes from the prefill and tokens 2 to 4 from verify steps: the first
verifies 2 drafts (the engine drafts at most the tokens still wanted - 1) and emits them with a bonus token
or stops at a rejection with a token from the residual, leaving the rest to a later step with fewer drafts.
So every path of verification feeds the marginals of tokens 2 to 4. Sampled requests draw their drafts from
the drafter's distribution q (draft_sampling.py), verified against q: EAGLE here, EAGLE-3 (a reduced
vocabulary: q is 0 on the target's other ids) and DFlash (every position drawn at once) too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from spec_sampling_runs import (
    BOUND,
    REQUESTS,
    SETTINGS,
    VOCAB,
    drawing_session,
    exact_marginals,
    run_requests,
    total_variations,
)
from spec_sampling_runs import session as session  # the module-scoped fixture
from verify_reference import accepts_all, without_residual

import executor_service.spec_decode.verifier as verifier
from executor_service.sample.sampling import DraftProbs
from executor_service.server.session import ModelSession
from executor_service.spec_decode.draft_sampling import DraftSampler, StepDraws


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_keeps_the_target_distribution(session: ModelSession, name: str) -> None:
    settings = SETTINGS[name]
    exact = exact_marginals(session.loaded.model, settings)
    empirical, drafted, accepted = run_requests(session, settings)
    assert 0 < accepted < drafted  # both paths of verification ran, many times
    assert min(accepted, drafted - accepted) > REQUESTS // 10
    distances = total_variations(empirical, exact)
    assert max(distances) < BOUND, distances


@pytest.mark.parametrize(
    ("method", "support", "path"),
    [("eagle3", 32, "device"), ("dflash", 32, "device"), ("eagle", 2, "device"), ("eagle3", 32, "host")],
)
def test_sampled_drafts_of_the_other_drafters_keep_the_target_distribution(
    method: str, support: int, path: str
) -> None:
    """Drafts drawn from q, verified on the device step (and on the host path alone): EAGLE-3 and DFlash; EAGLE with
    q kept on the drafter's 2 most likely ids of 6 (DRAFT_SUPPORT is 32)."""
    session = drawing_session(method, path)
    assert session.proposer is not None
    session.proposer.draft_support = support
    settings = SETTINGS["temperature"]
    exact = exact_marginals(session.loaded.model, settings)
    empirical, drafted, accepted = run_requests(session, settings)
    assert 0 < accepted < drafted
    distances = total_variations(empirical, exact)
    assert max(distances) < BOUND, distances
    if path == "device":  # the drawn drafts' steps ran on the device step, q carried through it
        assert session.engine.step_counts["device"] > 0 and session.engine.spec_step.counts["sampled"] > 0


TRUE_PROBS_OF = DraftSampler.probs_of


def uniform_q(self: DraftSampler, count: int) -> list[DraftProbs | None]:
    """In place of DraftSampler.probs_of: drafts drawn from q verified as if drawn from uniform weights, so
    they pass min(1, p / q) far too often. (Verifying them as point masses would be exact: that rule holds
    for a draft however it was chosen, it only accepts less.)"""
    found = TRUE_PROBS_OF(self, count)
    return [None if q is None else DraftProbs(q.ids, torch.full_like(q.probs, 1.0 / VOCAB)) for q in found]


TRUE_STEP_Q = StepDraws.q


def uniform_step_q(self: StepDraws) -> tuple[torch.Tensor, torch.Tensor]:
    """In place of StepDraws.q: the device step's drawn drafts verified as if drawn from uniform weights."""
    ids, probs = TRUE_STEP_Q(self)
    return ids, torch.full_like(probs, 1.0 / VOCAB)


@pytest.mark.parametrize(
    ("path", "part", "broken"),
    [
        ("host", "_q_hits", accepts_all),
        ("host", "_rejected_q", without_residual),
        ("host", "DraftSampler.probs_of", uniform_q),
        ("device", "_greedy_hits", accepts_all),
        ("device drawn", "_q_hits", accepts_all),
        ("device drawn", "_rejected_q", without_residual),
        ("device drawn", "StepDraws.q", uniform_step_q),
    ],
)
def test_the_bound_catches_a_wrong_verification(
    session: ModelSession, path: str, part: str, broken: Callable[..., object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one verifier's parts on the host path with drafts drawn from q, on the device step with argmax drafts,
    and on the device step with drafts drawn from q."""
    settings = SETTINGS["temperature"]
    exact = exact_marginals(session.loaded.model, settings)
    assert session.proposer is not None
    monkeypatch.setattr(session.proposer, "sample_drafts", path != "device")
    if path == "host":
        monkeypatch.setattr(session.engine, "spec_step", None)
    if part == "DraftSampler.probs_of":
        monkeypatch.setattr(DraftSampler, "probs_of", broken)
    elif part == "StepDraws.q":
        monkeypatch.setattr(StepDraws, "q", broken)
    else:
        monkeypatch.setattr(verifier, part, broken)
    empirical, _, _ = run_requests(session, settings)
    distances = total_variations(empirical, exact)
    assert distances[0] < BOUND  # the prefill verifies no drafts: the broken samplers get token 1 right
    assert max(distances[1:]) > BOUND, distances

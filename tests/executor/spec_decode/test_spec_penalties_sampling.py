"""Speculative sampling keeps the penalised target distribution (repetition, presence and frequency penalties,
min-p, a logit bias), measured as test_spec_sampling does: the emitted tokens of many seeded requests against the exact
marginals, every continuation enumerated with the penalties written out from their definitions
(penalty_reference.py). The requests run on the device step (its extras variant: device_penalties.py). A
verification that penalises each row without the drafts before it (as if they had not been emitted) is caught
by the same bound: measured 0.009 to 0.023 right, 0.089 on token 4 wrong (host path, before the device step
took these requests). Drafts drawn from q of the drafter's penalised logits keep it too.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from greedy_reference import dense_logits
from penalty_reference import reference_probs
from spec_sampling_runs import (
    BOUND,
    MAX_TOKENS,
    PROMPT,
    REQUESTS,
    VOCAB,
    drawing_session,
    run_requests,
    total_variations,
)
from spec_sampling_runs import session as session  # the module's fixture, shared

import executor_service.sample.penalties as penalties
from executor_service.models.model import DecoderModel
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from executor_service.spec_decode import verifier
from executor_service.spec_decode.verifier import DraftLayout

SETTINGS = {
    "penalised": SamplingSettings(
        temperature=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    ),
    "rewarded": SamplingSettings(  # < 1 and negative: repeating is favoured (the other branch of each)
        temperature=1.0,
        min_p=0.1,
        repetition_penalty=0.7,
        presence_penalty=-0.5,
        frequency_penalty=-0.3,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    ),
    "biased": SamplingSettings(  # a logit bias (one token lifted, one banned) under a penalty; drafts unbiased
        temperature=0.9,
        repetition_penalty=1.2,
        logit_bias=((2, 1.5), (4, -100.0)),
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    ),
}


def exact_marginals(model: DecoderModel, settings: SamplingSettings) -> torch.Tensor:
    """[MAX_TOKENS, VOCAB]: each emitted token's distribution, the penalties following every continuation."""
    joint = torch.zeros([VOCAB] * MAX_TOKENS, dtype=torch.float64)
    for prefix in itertools.product(range(VOCAB), repeat=MAX_TOKENS - 1):
        rows = dense_logits(model, PROMPT + list(prefix))[-MAX_TOKENS:]
        probs = [reference_probs(rows[i], PROMPT, list(prefix[:i]), settings) for i in range(MAX_TOKENS)]
        chance = torch.prod(torch.stack([probs[i][token] for i, token in enumerate(prefix)]))
        joint[prefix] = chance * probs[-1]
    return torch.stack([joint.sum(dim=[d for d in range(MAX_TOKENS) if d != i]) for i in range(MAX_TOKENS)])


def counts_without_drafts(output: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """Wrong: every verify row penalised with the emitted tokens only, the drafts before it left out."""
    return output.unsqueeze(0).repeat(len(drafts) + 1, 1)


def no_drafts_on_path(layout: DraftLayout, constants: StepConstants) -> torch.Tensor:
    """The device step's same mistake (verifier.on_path): no draft counted at any row."""
    num = layout.tokens.shape[1]
    return torch.zeros(1, num + 1, num, dtype=torch.bool)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_keeps_the_penalised_distribution(session: ModelSession, name: str) -> None:
    settings = SETTINGS[name]
    exact = exact_marginals(session.loaded.model, settings)
    extras = session.engine.spec_step.counts["extras"]
    empirical, drafted, accepted = run_requests(session, settings)
    assert min(accepted, drafted - accepted) > REQUESTS // 10  # both paths of verification, many times
    assert session.engine.spec_step.counts["extras"] > extras  # on the device step
    distances = total_variations(empirical, exact)
    assert max(distances) < BOUND, distances


@pytest.mark.parametrize(("method", "path"), [("eagle3", "device"), ("dflash", "device"), ("eagle3", "host")])
def test_penalised_drafts_drawn_from_q_keep_the_penalised_distribution(method: str, path: str) -> None:
    """Drafts drawn from q of the drafter's penalised logits (draft_penalties.py: the history and the drafts before
    each counted), verified against that q: EAGLE-3 (its reduced vocabulary) and DFlash (its block position by
    position) on the device step, EAGLE-3 on the host path."""
    session = drawing_session(method, path)
    settings = SETTINGS["penalised"]
    exact = exact_marginals(session.loaded.model, settings)
    empirical, drafted, accepted = run_requests(session, settings)
    assert min(accepted, drafted - accepted) > REQUESTS // 10
    if path == "device":
        assert session.engine.spec_step.counts["extras"] > 0
    distances = total_variations(empirical, exact)
    assert max(distances) < BOUND, distances


def test_the_bound_catches_penalties_that_forget_the_drafts(
    session: ModelSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = SETTINGS["penalised"]
    exact = exact_marginals(session.loaded.model, settings)
    monkeypatch.setattr(penalties, "counts_per_row", counts_without_drafts)
    monkeypatch.setattr(verifier, "on_path", no_drafts_on_path)
    empirical, _, _ = run_requests(session, settings)
    distances = total_variations(empirical, exact)
    assert distances[0] < BOUND  # the prefill verifies no drafts
    assert max(distances[1:]) > BOUND, distances

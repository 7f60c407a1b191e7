"""Penalties, min-p and logprobs on hand-made logits: each verify row penalised as if the drafts before it were
emitted, counts kept up to date across steps, min-p relative to the top probability, logprobs from the raw
logits, and overflow-proof numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from host_verify_runs import request_of
from penalty_reference import reference_logits

import executor_service.sample.penalties as penalties
from executor_service.sample.logprobs import batch_logprobs
from executor_service.sample.penalties import TokenCounts, penalised_logits
from executor_service.sample.sampling import SamplingSettings, target_probs
from executor_service.spec_decode.host_verify import TreeVerdict, verify_on_host

VOCAB = 40
PENALTIES = SamplingSettings(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.9)


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    token_counts: TokenCounts | None = None


@pytest.mark.parametrize("rows_per_pass", [128, 2])
def test_every_verify_row_counts_the_drafts_before_it(rows_per_pass: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(penalties, "ROWS_PER_PASS", rows_per_pass)  # 2: each request penalised in its own pass
    torch.manual_seed(0)
    histories = [History([1, 2, 3]), History([5, 5, 7], [9, 9, 30, 5]), History([8], [8, 3])]
    settings = [SamplingSettings(), PENALTIES, SamplingSettings(repetition_penalty=0.5, frequency_penalty=-1.0)]
    drafts = [[], [30, 9, 9, 12], [3]]
    logits = torch.randn(1 + 5 + 2, VOCAB) * 3  # both signs, so both branches of the repetition penalty
    out = penalised_logits(logits, settings, histories, drafts)
    assert torch.equal(out[0], logits[0])  # no penalty: untouched
    for request, start in ((1, 1), (2, 6)):
        history = histories[request]
        for j in range(len(drafts[request]) + 1):
            output = history.output_ids + drafts[request][:j]
            expected = reference_logits(logits[start + j], history.prompt_ids, output, settings[request])
            torch.testing.assert_close(out[start + j].double(), expected, rtol=1e-5, atol=1e-5)
    assert penalised_logits(logits, [SamplingSettings()] * 3, histories, drafts) is logits


def test_counts_follow_the_output_across_steps() -> None:
    history, logits = History([4]), torch.randn(1, VOCAB)
    for step in range(4):
        out = penalised_logits(logits, [PENALTIES], [history], [[]])
        expected = reference_logits(logits[0], history.prompt_ids, history.output_ids, PENALTIES)
        torch.testing.assert_close(out[0].double(), expected, rtol=1e-5, atol=1e-5)
        history.output_ids += [step, 4, step]
    assert history.token_counts is not None and history.token_counts.num_counted == 9


def test_greedy_verification_takes_the_argmax_of_the_penalised_rows() -> None:
    """Raw, token 1 leads every row. The draft 1 is accepted; row 1 penalises it as emitted, so the target's
    token there is 2 and the draft 1 is rejected. Without the drafts in the counts it would be accepted."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 1], logits[:, 2] = 5.0, 4.0
    settings = SamplingSettings(presence_penalty=2.0)
    assert verify_on_host(logits, [request_of(settings, 0, prompt=[7], output=[])], [[1, 1]]) == [
        TreeVerdict([0], [1, 2])
    ]
    unpenalised = request_of(SamplingSettings(), 0, prompt=[7], output=[])
    assert verify_on_host(logits, [unpenalised], [[1, 1]]) == [TreeVerdict([0, 1], [1, 1, 1])]


def test_sampled_verification_draws_from_the_penalised_rows() -> None:
    """Near-greedy sampling: row 0 is token 3's; penalised for the draft 3, row 1 is token 5's, so the second
    draft 3 is rejected and 5 drawn from the residual."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 3], logits[:, 5] = 1.0, 0.5
    settings = SamplingSettings(temperature=1e-3, frequency_penalty=2.0)
    assert verify_on_host(logits, [request_of(settings, 0, prompt=[0], output=[])], [[3, 3]]) == [
        TreeVerdict([0], [3, 5])
    ]
    unpenalised = request_of(SamplingSettings(temperature=1e-3), 0, prompt=[0], output=[])
    assert verify_on_host(logits, [unpenalised], [[3, 3]]) == [TreeVerdict([0, 1], [3, 3, 3])]


def test_min_p_keeps_tokens_within_a_fraction_of_the_top_one() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.04, 0.26]))
    probs = target_probs(logits, SamplingSettings(temperature=1.0, min_p=0.1))  # threshold 0.05
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0.0, 0.26]) / 0.96)
    hot = target_probs(logits, SamplingSettings(temperature=2.0, min_p=0.5))  # after temperature: 0.5 x top
    scaled = torch.softmax(logits / 2.0, dim=-1)
    torch.testing.assert_close(
        hot, torch.where(scaled < 0.5 * scaled.max(), 0.0, scaled) / scaled[scaled >= 0.5 * scaled.max()].sum()
    )
    assert torch.count_nonzero(target_probs(logits, SamplingSettings(temperature=1.0, min_p=1.0))) == 1


@pytest.mark.parametrize("repetition_penalty", [1e-30, 1e30])
def test_extreme_repetition_penalties_still_give_a_distribution(repetition_penalty: float) -> None:
    logits = torch.tensor([[3e4, -3e4, 1.0, -1.0]])
    settings = SamplingSettings(temperature=1e-5, repetition_penalty=repetition_penalty)
    out = penalised_logits(logits, [settings], [History([0, 1, 2, 3])], [[]])
    probs = target_probs(out[0], settings)
    assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)


def test_logprobs_are_the_raw_targets_for_every_emitted_token() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1 + 3 + 3, VOCAB)
    settings = [SamplingSettings(logprobs=5), SamplingSettings(), SamplingSettings(logprobs=0, temperature=0.5)]
    drafts, emitted = [[], [4, 5], [6, 7]], [[11], [4, 9], [6, 7, 8]]
    found = batch_logprobs(logits, settings, drafts, emitted)
    assert found[1] is None
    dense = torch.log_softmax(logits, dim=-1)
    for request, start in ((0, 0), (2, 4)):
        got = found[request]
        assert got is not None and [t.token_id for t in got] == emitted[request]
        for i, token in enumerate(got):
            assert token.logprob == pytest.approx(float(dense[start + i, token.token_id]), abs=1e-5)
            n = settings[request].logprobs
            top = dense[start + i].topk(n) if n else None
            assert [t for t, _ in token.top] == (top.indices.tolist() if top is not None else [])
    failed = batch_logprobs(logits[:1], settings[:1], [[]], [RuntimeError("failed")])
    assert failed == [None]

"""Sampled drafting (executor_service/spec_decode/draft_sampling.py): greedy rows keep the argmax, sampled rows
draw from q (the drafter's logits under the request's settings, on its most likely ids) and keep q, in the target's ids,
for verification.
Their noise is counter-based, keyed by the request's seed and the draft's position. The engine-level proof that
verification against q keeps the target's distribution is test_spec_sampling."""

from __future__ import annotations

import pytest
import torch
from spec_builders import spec_session

from executor_service.engine.request import Request
from executor_service.sample.sampling import DraftProbs, SamplingSettings, sampled_probs
from executor_service.spec_decode.draft_sampling import DraftSampler

VOCAB = 5


def request(settings: SamplingSettings, prompt: tuple[int, ...] = (1,)) -> Request:
    return Request("r", list(prompt), settings, 8, frozenset(), lambda _: None)


def dense(probs: DraftProbs | None, vocab: int = VOCAB) -> torch.Tensor:
    assert probs is not None
    return probs.dense(vocab, torch.device("cpu"))


def test_greedy_rows_keep_the_argmax_and_no_q() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    sampler = DraftSampler([request(SamplingSettings())] * 3, None)
    assert not DraftSampler.wanted([request(SamplingSettings())])
    assert torch.equal(sampler.pick(logits), logits.argmax(dim=-1))
    assert sampler.probs_of(3) == [None, None, None]


def test_sampled_rows_draw_from_q_and_keep_it() -> None:
    """Row 1 sampled (temperature and top-k), rows 0 and 2 greedy: the draws' frequencies are q's, and the q
    kept for row 1 is sampled_probs of its logits under its settings."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, -1.0]] * 3)
    settings = SamplingSettings(temperature=0.9, top_k=3)
    sampler = DraftSampler([request(SamplingSettings()), request(settings), request(SamplingSettings())], None)
    assert DraftSampler.wanted([request(SamplingSettings()), request(settings)])
    draws = torch.stack([sampler.pick(logits) for _ in range(4000)])
    assert (draws[:, 0] == 1).all() and (draws[:, 2] == 1).all()
    q = sampled_probs(logits[:1], [settings])[0]
    frequencies = torch.bincount(draws[:, 1], minlength=VOCAB) / draws.shape[0]
    assert frequencies[0] == 0 and frequencies[4] == 0  # outside the top 3
    assert (frequencies - q).abs().max() < 0.03, (frequencies, q)
    kept = sampler.probs_of(3)
    assert kept[0] is None and kept[2] is None and kept[1] is not None
    assert kept[1].ids.shape == (4000, VOCAB)
    torch.testing.assert_close(dense(kept[1]), q.expand(4000, VOCAB))


def test_q_keeps_the_drafters_most_likely_ids_renormalised() -> None:
    """With a support of 2 of 5 ids the draws come from the two most likely, in their renormalised ratio, and
    that is the q kept: what the drafts were drawn from."""
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.05, 0.2, 0.25]]))
    sampler = DraftSampler([request(SamplingSettings(temperature=1.0))], None, support=2)
    draws = torch.cat([sampler.pick(logits) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=VOCAB) / draws.shape[0]
    expected = torch.tensor([0.0, 0.4 / 0.65, 0.0, 0.0, 0.25 / 0.65])
    assert (frequencies - expected).abs().max() < 0.03, frequencies
    (kept,) = sampler.probs_of(1)
    assert kept is not None and kept.ids.shape == (4000, 2)
    torch.testing.assert_close(dense(kept)[0], expected)


def test_reduced_vocabulary_q_lands_on_the_target_ids() -> None:
    """EAGLE-3's head covers target ids [4, 0, 2] of 6: q in the target's vocabulary is 0 elsewhere."""
    vocab_ids = torch.tensor([4, 0, 2])
    sampler = DraftSampler([request(SamplingSettings(temperature=1.0))], vocab_ids)
    drawn = sampler.pick(torch.tensor([[1.0, 2.0, 0.0]]))
    assert 0 <= int(drawn[0]) < 3  # a draft-vocabulary id: the proposer maps it
    (q,) = sampler.probs_of(1)
    expected = torch.zeros(6)
    expected[vocab_ids] = torch.softmax(torch.tensor([1.0, 2.0, 0.0]), dim=-1)
    torch.testing.assert_close(dense(q, 6)[0], expected)


def test_seeded_requests_draw_the_same_drafts() -> None:
    settings = SamplingSettings(temperature=1.0, seed=7)
    logits = torch.zeros(1, 1000)

    def draws() -> list[int]:
        sampler = DraftSampler([request(settings)], None)
        return [int(sampler.pick(logits)[0]) for _ in range(5)]

    assert draws() == draws()
    assert len(set(draws())) > 1


def test_a_drafts_noise_is_keyed_by_its_seed_and_position_not_its_batch() -> None:
    """A seeded request draws the same drafts alone and beside others; one a token further along draws at its
    first position what the other drew at its second (the same position), and another seed draws otherwise."""
    settings = SamplingSettings(temperature=1.0, seed=7)
    logits = torch.zeros(3, 1000)

    def draws(requests: list[Request], row: int, picks: int = 3) -> list[int]:
        sampler = DraftSampler(requests, None)
        return [int(sampler.pick(logits[: len(requests)])[row]) for _ in range(picks)]

    alone = draws([request(settings)], 0)
    others = [request(SamplingSettings(temperature=0.8)), request(SamplingSettings())]
    assert draws([others[0], request(settings), others[1]], 1) == alone
    assert draws([request(settings, (1, 5))], 0, 2) == alone[1:]
    assert draws([request(SamplingSettings(temperature=1.0, seed=8))], 0) != alone


def test_logits_without_a_distribution_draw_from_uniform_and_keep_it() -> None:
    """A faulty drafter's NaN row draws uniformly among the ids it kept, and uniform is the q kept:
    verification against it stays exact, where q = NaN would reject every draft and q = point mass would
    favour it."""
    sampler = DraftSampler([request(SamplingSettings(temperature=1.0))], None)
    sampler.pick(torch.full((1, VOCAB), float("nan")))
    (q,) = sampler.probs_of(1)
    torch.testing.assert_close(dense(q), torch.full((1, VOCAB), 1.0 / VOCAB))


@pytest.mark.parametrize(
    ("setting", "graphs", "expected"),
    [(None, False, False), (None, True, False), (True, True, True), (True, False, True), (False, False, False)],
)
def test_which_drafts_a_sampled_request_gets(setting: bool | None, graphs: bool, expected: bool) -> None:
    """--sampled-drafts: on, off, or auto (the argmax: the rule does not depend on CUDA graphs). The drafts
    follow: q kept for verification (on the host path), or argmax drafts without one (the device step)."""
    session = spec_session("eagle3", 3)
    proposer = session.proposer
    assert proposer is not None
    proposer.sample_drafts = setting
    proposer.graphs = {"stand-in": None} if graphs else {}  # type: ignore[dict-item]
    assert proposer.samples_drafts() is expected
    proposer.graphs = {}
    sampled = SamplingSettings(temperature=0.8, max_tokens=6, ignore_eos=True, seed=1)
    found: list[bool] = []
    record = proposer.set_drafts

    def recording(request: Request, ids: list[int], probs: DraftProbs | None = None) -> None:
        found.append(probs is not None)
        record(request, ids, probs)

    proposer.set_drafts = recording  # type: ignore[method-assign]
    proposer.sample_drafts = expected
    session.engine.add(session.new_request("r", [1, 2, 3], sampled, 6, lambda _: None))
    session.engine.run_until_idle()
    assert found and set(found) == {expected}


def test_a_block_of_positions_draws_each_from_its_own_q() -> None:
    """DFlash's block in one pick [B, n, Vd]: each position's draws follow that position's q, the greedy row
    keeps its argmax, and q comes back per request as [n, V]."""
    logits = torch.tensor([[[4.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 2.0]]]).repeat(2, 1, 1)
    settings = SamplingSettings(temperature=1.0)
    sampler = DraftSampler([request(SamplingSettings()), request(settings)], None)
    draws = torch.stack([sampler.pick(logits) for _ in range(3000)])  # [3000, 2, 2]
    assert (draws[:, 0, 0] == 0).all() and (draws[:, 0, 1] == 4).all()
    for position in range(2):
        frequencies = torch.bincount(draws[:, 1, position], minlength=VOCAB) / draws.shape[0]
        assert (frequencies - torch.softmax(logits[1, position], dim=-1)).abs().max() < 0.03
    kept = sampler.probs_of(2)
    assert kept[0] is None and kept[1] is not None and kept[1].ids.shape == (6000, VOCAB)
    torch.testing.assert_close(dense(kept[1])[:2], torch.softmax(logits[1], dim=-1))

"""Batched rejection sampling (verify_batch, rejection_sample_batch) on one mixed batch: greedy and sampled
requests, temperatures, top-k, top-p, min-p, penalties, 0 to 3 drafts, seeded and unseeded, all verified in one
pass. Each request's emitted tokens follow its own target distribution (a wrong residual is caught), a seeded
request gives the same tokens alone and in the batch, and the whole batch costs one host copy."""

from __future__ import annotations

import pytest
import torch
from batched_rejection_runs import (
    BOUND,
    PENALTIES,
    REWARDS,
    TRIALS,
    VOCAB,
    alone_and_together,
    counting,
    drafter_distances,
    mixed_batch,
    mixed_distances,
    run_batch,
)
from engine_driving import Collector
from spec_builders import spec_session

import executor_service.host_step as host_step
import executor_service.rejection_sampler as rejection_sampler
import executor_service.sampling as sampling
from executor_service.rejection_sampler import verify_batch
from executor_service.sampling import SamplingSettings, make_generator, target_probs, to_host


def test_a_mixed_batch_keeps_every_target_distribution() -> None:
    distances, batch, emitted = mixed_distances(torch.device("cpu"))
    assert max(distances) < BOUND, distances
    assert all(tokens == emitted[0][0] for tokens in emitted[0])  # greedy: the same every time
    # The second token, given the first draft was accepted, follows row 1 (penalised as if draft 0 was emitted).
    for request in (1, 4, 6):
        seconds = [t[1] for t in emitted[request] if len(t) > 1]
        assert len(seconds) > TRIALS // 5, (request, len(seconds))  # both paths ran, many times
        assert len(seconds) < TRIALS * 0.9, (request, len(seconds))
        counts = torch.bincount(torch.tensor(seconds), minlength=VOCAB)
        distance = 0.5 * float((counts / counts.sum() - batch.exact(request, 1)).abs().sum())
        assert distance < 2 * BOUND, (request, distance)  # fewer samples than the first token's


def test_the_bound_catches_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection_sampler, "residual_weights", lambda final, *_: final)  # p, not max(0, p - q)
    distances, _, _ = mixed_distances(torch.device("cpu"))
    assert max(distances) > 2 * BOUND, distances


@pytest.mark.parametrize("rows_per_pass", [128, 3])
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_the_batch(
    rows_per_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also when the batch is verified in several passes (3 rows: about one request each)."""
    monkeypatch.setattr(rejection_sampler, "ROWS_PER_PASS", rows_per_pass)
    for alone, together in alone_and_together(torch.device("cpu")):
        assert alone == together


def one_request_reference(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """Rejection sampling of one request with point-mass drafts, written out draw by draw as the per-request
    sampler did it: k uniforms, then torch.multinomial over the residual (or the bonus row)."""
    uniforms = torch.rand(len(drafts), generator=generator)
    for j, draft in enumerate(drafts):
        if float(uniforms[j]) > float(probs[j, draft]):
            residual = probs[j].clone()
            residual[draft] = 0.0
            weights = residual if float(residual.sum()) > 0 else probs[j]
            return [*drafts[:j], int(torch.multinomial(weights, 1, generator=generator))]
    return [*drafts, int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]


def test_seeded_tokens_follow_the_per_request_draw_order() -> None:
    """A seeded request's tokens are those of the per-request sampler that came before the batched pass (the
    same draws from its generator, in the same order), so seeded outputs stay what they were."""
    device = torch.device("cpu")
    batch = mixed_batch(device, seed=2)
    generators = [make_generator(s, device) for s in batch.settings]
    starts = batch.starts()
    for request in (1, 3, 5):  # seeded, no penalties: probabilities are target_probs of the raw rows
        settings, drafts = batch.settings[request], batch.drafts[request]
        probs = target_probs(batch.logits[starts[request] : starts[request] + len(drafts) + 1], settings)
        reference = make_generator(settings, device)
        assert reference is not None
        expected = [one_request_reference(probs, drafts, reference) for _ in range(30)]
        assert run_batch(batch, generators, 30)[request] == expected, request
        generators = [make_generator(s, device) for s in batch.settings]


def test_the_whole_batch_costs_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(rejection_sampler, "to_host", counting(calls, to_host))
    monkeypatch.setattr(sampling, "to_host", counting(calls, to_host))
    monkeypatch.setattr(rejection_sampler, "ROWS_PER_PASS", 3)  # several passes, still one copy
    device = torch.device("cpu")
    batch = mixed_batch(device)
    run_batch(batch, [make_generator(s, device) for s in batch.settings], 3)
    assert len(calls) == 3, calls  # one per verify_batch call


def test_sampled_drafters_in_one_batch() -> None:
    distances = drafter_distances(torch.device("cpu"))
    assert max(distances) < BOUND, distances


def test_an_engine_step_of_sampled_requests_verifies_with_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (EAGLE, k = 3): a batch of sampled requests with their own k (0 to 3), penalties,
    min-p, top-k and top-p, seeded and not, makes one host copy in each verification (verify_batch)."""
    session = spec_session("eagle", 3, vocab_size=64)
    copies: list[int] = []
    verified: list[int] = []
    monkeypatch.setattr(rejection_sampler, "to_host", counting(copies, to_host))
    monkeypatch.setattr(sampling, "to_host", counting(copies, to_host))
    monkeypatch.setattr(host_step, "verify_batch", counting(verified, verify_batch))
    sink = Collector()
    settings = [
        SamplingSettings(0.8, seed=1, ignore_eos=True),
        SamplingSettings(1.2, top_p=0.9, top_k=10, ignore_eos=True),
        SamplingSettings(0.9, min_p=0.05, seed=3, ignore_eos=True, **PENALTIES),
        SamplingSettings(1.0, ignore_eos=True, **REWARDS),
    ]
    for i, setting in enumerate(settings * 2):
        session.engine.add(session.new_request(f"r{i}", [3, 1, 4, 1, 5], setting, 12, sink, i % 4))
    session.engine.run_until_idle()
    assert all(len(sink.tokens(f"r{i}")) == 12 for i in range(8))
    assert len(verified) > 3 and len(copies) == len(verified), (len(copies), len(verified))

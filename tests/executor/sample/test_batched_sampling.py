"""Sampled requests without drafts (host_verify.verify_on_host, a batch of roots alone) draw from each row's own
distribution, with each request's own seed, whatever else is in the batch."""

from __future__ import annotations

from dataclasses import replace

import torch
from host_verify_runs import request_of

from executor_service.sample.sampling import SamplingSettings, sampled_probs, target_probs
from executor_service.spec_decode.host_verify import TreeVerdict, VerifyError, verify_on_host


def sample(logits: torch.Tensor, settings: list[SamplingSettings], draw: int = 0) -> list[TreeVerdict | VerifyError]:
    """One token per row: each row a request without drafts; `draw` picks the requests' seeds (0: their own)."""
    requests = [
        request_of(replace(s, seed=s.seed + draw) if s.seed is not None else s, i) for i, s in enumerate(settings)
    ]
    return verify_on_host(logits, requests, [[] for _ in settings])


def _histogram(rows: torch.Tensor, settings: list[SamplingSettings], draws: int) -> torch.Tensor:
    counts = torch.zeros(rows.shape)
    for draw in range(draws):
        for row, verdict in enumerate(sample(rows, settings, 1000 * draw)):
            assert isinstance(verdict, TreeVerdict)
            counts[row, verdict.emitted[0]] += 1
    return counts / draws


def test_each_sampled_row_follows_its_own_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    settings = [SamplingSettings(0.7, seed=1), SamplingSettings(0.0), SamplingSettings(1.3, seed=2),
                SamplingSettings(1.0, seed=3, top_k=3)]  # fmt: skip
    empirical = _histogram(logits, settings, draws=3000)
    for row in (0, 2, 3):
        exact = target_probs(logits[row], settings[row])
        assert (empirical[row] - exact).abs().sum() / 2 < 0.045, row  # total variation distance
    assert empirical[1, logits[1].argmax()] == 1.0  # the greedy row
    assert empirical[3][target_probs(logits[3], settings[3]) == 0].sum() == 0  # top-k: nothing outside


def test_a_wrong_temperature_is_caught() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 2
    empirical = _histogram(logits, [SamplingSettings(0.5, seed=4)], draws=3000)
    wrong = target_probs(logits[0], SamplingSettings(1.0))  # what a sampler ignoring temperature would give
    assert (empirical[0] - wrong).abs().sum() / 2 > 0.1


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [SamplingSettings(0.9, seed=7)])
    settings = [SamplingSettings(0.8, seed=5), SamplingSettings(0.9, seed=7), SamplingSettings(0.0)]
    together = sample(logits, settings)
    assert together[1] == alone[0]


def test_a_row_without_a_distribution_fails_alone() -> None:
    logits = torch.randn(2, 8)
    logits[0, 3] = float("nan")
    settings = [SamplingSettings(0.7, seed=1), SamplingSettings(0.7, seed=2)]
    out = sample(logits, settings)
    assert isinstance(out[0], VerifyError) and isinstance(out[1], TreeVerdict) and len(out[1].emitted) == 1


def test_mixed_filters_in_one_pass_equal_each_rows_own() -> None:
    """sampled_probs filters every row at once with its own temperature, min-p, top-k and top-p (none, some or
    all of them; ties and a NaN row too): the same numbers as target_probs row by row."""
    vocab, generator = 64, torch.Generator().manual_seed(3)
    settings = [
        SamplingSettings(0.7),
        SamplingSettings(1.0, top_k=5),
        SamplingSettings(1.3, top_p=0.6),
        SamplingSettings(0.9, min_p=0.2),
        SamplingSettings(1.1, top_k=20, top_p=0.8, min_p=0.05),
        SamplingSettings(0.5, top_k=1),
        SamplingSettings(1.0, top_k=vocab, top_p=1.0),
        SamplingSettings(1.0, top_k=3, top_p=0.5),
    ]
    logits = (torch.randn(len(settings), vocab, generator=generator) * 3).round()  # rounded: many ties
    logits[7, 5] = float("nan")
    batched = sampled_probs(logits, settings)
    for row, setting in enumerate(settings):
        torch.testing.assert_close(batched[row], target_probs(logits[row], setting), equal_nan=True, rtol=0, atol=0)
    assert all((batched[row] == 0).any() for row in range(1, 6)) and batched[7].isnan().all()  # filters ran

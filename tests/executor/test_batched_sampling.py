"""Sampled rows drawn together (sampling.sample, and verify_batch for requests without drafts) draw from each
row's own distribution, with each row's own seed, whatever else is in the batch."""

from __future__ import annotations

import torch

from executor_service.rejection_sampler import verify_batch
from executor_service.sampling import (
    SamplingError,
    SamplingSettings,
    make_generator,
    sample,
    sampled_probs,
    target_probs,
)

CPU = torch.device("cpu")


def _histogram(rows: torch.Tensor, settings: list[SamplingSettings], draws: int) -> torch.Tensor:
    counts = torch.zeros(rows.shape)
    generators = [make_generator(s, CPU) for s in settings]
    for _ in range(draws):
        for row, token in enumerate(sample(rows, settings, generators)):
            assert isinstance(token, int)
            counts[row, token] += 1
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
    alone = [sample(logits[1:2], [SamplingSettings(0.9, seed=7)], [make_generator(SamplingSettings(0.9, seed=7), CPU)])]
    settings = [SamplingSettings(0.8, seed=5), SamplingSettings(0.9, seed=7), SamplingSettings(0.0)]
    generators = [make_generator(s, CPU) for s in settings]
    together = sample(logits, settings, generators)
    assert together[1] == alone[0][0]


def test_a_row_without_a_distribution_fails_alone() -> None:
    logits = torch.randn(2, 8)
    logits[0, 3] = float("nan")
    settings = [SamplingSettings(0.7, seed=1), SamplingSettings(0.7, seed=2)]
    out = sample(logits, settings, [make_generator(s, CPU) for s in settings])
    assert isinstance(out[0], SamplingError) and isinstance(out[1], int)
    emitted = verify_batch(logits, settings, [make_generator(s, CPU) for s in settings], [[], []])
    assert not isinstance(emitted[0], list) and isinstance(emitted[1], list) and len(emitted[1]) == 1


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

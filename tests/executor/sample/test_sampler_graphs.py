"""The sampled decode draw replayed from static inputs (sample/sampler_graphs.py) against the same draw launched op by
op (`eager_draw`, as the serial path samples): equal flags and tokens bit for bit, for batches that mix greedy,
temperature, top-k, top-p and min-p rows, across buckets whose padded rows hold an earlier batch's values, with a
row of logits that is not finite, and past the largest bucket. On the CPU the buffers and padding are exercised
without graphs; on a GPU every (sort, bucket) is a captured graph replayed with new inputs."""

from __future__ import annotations

import pytest
import torch

from executor_service.sample.sampler_graphs import SamplerGraphs, eager_draw
from executor_service.sample.sampling import SamplingSettings, host_sort, needs_sort

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 300
KINDS = [
    SamplingSettings(),
    SamplingSettings(0.7),
    SamplingSettings(1.0, top_k=5),
    SamplingSettings(0.9, top_p=0.8),
    SamplingSettings(1.2, min_p=0.1),
    SamplingSettings(0.6, top_k=40, top_p=0.95),
]


def batch(count: int, seed: int, kinds: list[SamplingSettings] = KINDS) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(count, VOCAB, generator=generator) * 3).to(DEVICE)
    settings = [kinds[(seed + i) % len(kinds)] for i in range(count)]
    seeds = [1000 * seed + i for i in range(count)]
    roots = [17 + 3 * i + seed for i in range(count)]
    return logits, settings, seeds, roots


def both(sampler: SamplerGraphs, logits, settings, seeds, roots) -> tuple[list[int], list[int]]:
    replayed = sampler.draw(logits, settings, seeds, roots, needs_sort(settings, VOCAB))
    eager = eager_draw(logits, settings, seeds, roots, host_sort(settings, VOCAB))
    return replayed.tolist(), eager.tolist()


def test_draws_equal_the_eager_path_across_buckets_and_stale_padding() -> None:
    sampler = SamplerGraphs(max_batch=8)
    for count, seed in [(5, 1), (3, 2), (1, 3), (8, 4), (2, 5), (5, 6)]:  # 5 then 3 in bucket 8's and 4's buffers
        replayed, eager = both(sampler, *batch(count, seed))
        assert replayed == eager, (count, seed)
        assert replayed[:count] == [1] * count and replayed[count : 2 * count] == [1] * count
    only_temperature = [SamplingSettings(0.7), SamplingSettings()]  # the unsorted variant of the same buckets
    for count, seed in [(3, 7), (2, 8)]:
        replayed, eager = both(sampler, *batch(count, seed, only_temperature))
        assert replayed == eager
    assert {sort for sort, _ in sampler.graphs} == {True, False}
    if DEVICE.type == "cuda":
        assert all(graph is not None for graph in sampler.graphs.values()), "every key captured"


def test_a_row_that_is_not_finite_is_flagged_alone() -> None:
    sampler = SamplerGraphs(max_batch=4)
    logits, settings, seeds, roots = batch(3, 9, [SamplingSettings(0.8)])
    logits[1, 7] = float("nan")
    replayed, eager = both(sampler, logits, settings, seeds, roots)
    assert replayed == eager
    assert replayed[:3] == [1, 0, 1]


def test_more_rows_than_the_largest_bucket_draw_eagerly() -> None:
    sampler = SamplerGraphs(max_batch=4)
    replayed, eager = both(sampler, *batch(6, 10))
    assert replayed == eager
    assert not sampler.graphs


@pytest.mark.parametrize("count", [1, 4])
def test_a_seeded_row_draws_the_same_alone_and_in_a_batch(count: int) -> None:
    sampler = SamplerGraphs(max_batch=8)
    logits, settings, seeds, roots = batch(count, 11, [SamplingSettings(0.9, top_p=0.9)])
    together = sampler.draw(logits, settings, seeds, roots, True).view(3, count)[2].tolist()
    alone = [sampler.draw(logits[i : i + 1], settings[i : i + 1], seeds[i : i + 1], roots[i : i + 1], True)[2].item()
             for i in range(count)]  # fmt: skip
    assert together == alone

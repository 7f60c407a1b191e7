"""The sampled decode draw replayed from static inputs (engine/sampler_graphs.py) against the same draw launched op by
op (`eager_draw`, as the serial path samples): equal flags and tokens bit for bit, for batches that mix greedy,
temperature, top-k, top-p and min-p rows, across buckets whose padded rows hold an earlier batch's values, with a
row of logits that is not finite, past the largest bucket, and with penalties, a logit bias and logprobs (the
penalty table counting each drawn token once). On the CPU the buffers and padding are exercised
without graphs; on a GPU every (sort, bucket) is a captured graph replayed with new inputs."""

from __future__ import annotations

import pytest
import torch

from executor_service.engine.sampler_graphs import HostExtras, SamplerGraphs, eager_draw
from executor_service.sample.sampling import SamplingSettings, host_sort, needs_sort
from executor_service.spec_decode.device_penalties import PenaltyTable, logprob_width

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
    assert {sort for sort, _, _ in sampler.graphs} == {True, False}
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


def penalty_table(seed: int) -> PenaltyTable:
    """Two penalised slots with prompt tokens and earlier output counts, one with a logit bias."""
    table = PenaltyTable(4, VOCAB, DEVICE)
    table.allocate()
    assert table.in_prompt is not None and table.output is not None
    assert table.bias_ids is not None and table.bias_values is not None
    generator = torch.Generator().manual_seed(seed)
    for slot in (0, 1):
        table.in_prompt[slot, torch.randint(VOCAB, (20,), generator=generator).to(DEVICE)] = True
        table.output[slot] = torch.randint(0, 3, (VOCAB,), generator=generator, dtype=torch.int32).to(DEVICE)
    table.bias_ids[1, :2] = torch.tensor([3, 4], device=DEVICE)
    table.bias_values[1, :2] = torch.tensor([8.0, -50.0], device=DEVICE)
    return table


def test_penalties_and_logprobs_draw_and_count_as_the_eager_path() -> None:
    """Rows penalised from their slots (greedy and sampled, sorted and not), every row's logprobs read back; each
    draw counts its penalised rows' tokens in their slots once (a capture's run before it counts nothing)."""
    sampler, tables = SamplerGraphs(max_batch=8), [penalty_table(3), penalty_table(3)]
    slots, params = [0, -1, 1], [(1.3, 0.5, 0.2), (1.0, 0.0, 0.0), (1.0, 0.0, 0.8)]
    for seed, kinds in [(12, [SamplingSettings(), SamplingSettings(0.8)]), (13, KINDS), (14, KINDS)]:
        logits, settings, seeds, roots = batch(3, seed, kinds)
        before = tables[0].output.clone()  # type: ignore[union-attr]
        replayed = sampler.draw(
            logits, settings, seeds, roots, needs_sort(settings, VOCAB), HostExtras(tables[0], slots, params)
        )
        eager = eager_draw(
            logits, settings, seeds, roots, host_sort(settings, VOCAB), HostExtras(tables[1], slots, params)
        )
        assert replayed.tolist() == eager.tolist(), seed
        assert torch.equal(tables[0].output, tables[1].output)  # type: ignore[arg-type]
        tokens = replayed[6:9].tolist()
        added = tables[0].output - before  # type: ignore[operator]
        assert added.sum().item() == 2 and added[0, tokens[0]] == 1 and added[1, tokens[2]] == 1
        assert replayed.shape[0] == 3 * 3 + 3 * (1 + 2 * logprob_width(VOCAB))
    if DEVICE.type == "cuda":
        assert all(graph is not None for graph in sampler.graphs.values()), "every key captured"


def test_the_captured_draw_finds_the_argmax_once_and_builds_no_index_tensors() -> None:
    """The op-count guard of the draw the graphs capture: without penalties the rows' argmax found once (the
    checked one, which verify then reads; before 2026-11-29 verify found its own), and with the graphs'
    StepConstants warmed (as the eager run before a capture warms them) two aranges fewer than a draw that builds
    its index tensors (the control: they are counted)."""
    from op_counting import OpCounter

    from executor_service.engine.sampler_graphs import DecodeExtras, draw_read_back
    from executor_service.runner.step_constants import StepConstants
    from executor_service.sample.device_sampling import SamplingTensors, StepKeys

    logits, settings, seeds, roots = batch(4, 7)
    table = PenaltyTable(4, VOCAB, DEVICE)
    table.allocate()
    slot = torch.tensor([0, -1, 1, -1], device=DEVICE)
    penalty = torch.tensor([[1.2, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.5, 0.1], [1.0, 0.0, 0.0]], device=DEVICE)

    def count(name: str, extras: DecodeExtras | None, constants: StepConstants | None) -> int:
        sampling = SamplingTensors.build(settings, seeds, DEVICE)
        keys = StepKeys.on_host(seeds, roots, DEVICE)
        counter = OpCounter(lambda func: name in str(func))
        with counter:
            draw_read_back(logits, sampling, keys, needs_sort(settings, VOCAB), extras, constants)
        return counter.count

    warmed = StepConstants(DEVICE)
    extras = DecodeExtras(table, slot, penalty)
    count("arange", extras, warmed)
    assert count("arange", extras, warmed) <= count("arange", extras, None) - 2
    if DEVICE.type == "cpu":  # torch's argmax (the GPU's is the fused kernel, not one op)
        assert count("argmax", None, warmed) == 2  # the checked one and the draw's race (3 before)
        assert count("argmax", extras, warmed) == 3  # penalties change it: verify finds its own


def test_capture_all_takes_every_key_at_load_and_draws_as_the_eager_path() -> None:
    """`capture_all` (load): every (sorted, extras, bucket) captured (on the CPU: marked eager), the table
    allocated, and draws with extras afterwards still the eager path's, counting in the same table."""
    sampler = SamplerGraphs(max_batch=8)
    table = PenaltyTable(4, VOCAB, DEVICE)
    sampler.capture_all(table)
    assert table.output is not None and sampler.table is table
    assert set(sampler.graphs) == {(s, e, b) for s in (False, True) for e in (False, True) for b in sampler.buckets}
    logits, settings, seeds, roots = batch(3, 9)
    extras = HostExtras(table, [0, -1, 1], [(1.3, 0.0, 0.0), (1.0, 0.0, 0.0), (1.0, 0.4, 0.2)])
    replayed = sampler.draw(logits, settings, seeds, roots, needs_sort(settings, VOCAB), extras)
    counted = table.output.clone()
    table.output.zero_()
    eager = eager_draw(logits, settings, seeds, roots, host_sort(settings, VOCAB), extras)
    assert replayed.tolist() == eager.tolist()
    assert torch.equal(counted, table.output)

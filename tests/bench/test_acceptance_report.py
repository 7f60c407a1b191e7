"""bench/acceptance_bench.py's timed runs and speedup report: requests take the run's places in turn (the mix's kind
and the seed of that place, at batch 1 too), ratios per round against the same round's target-only run, and the
share of requests whose tokens equal target-only's (seeded sampled runs with argmax drafts must emit its tokens)."""

from __future__ import annotations

import pytest

acceptance_bench = pytest.importorskip("acceptance_bench")

from executor_builders import tiny_session  # noqa: E402
from spec_builders import spec_session  # noqa: E402
from spec_checks import prompts  # noqa: E402

from executor_service.engine.request import Finish  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402


def timed(rate: float, token_ids: list[list[int]]) -> acceptance_bench.Timed:
    finish = Finish("length", prompt_tokens=4, completion_tokens=2, drafted_tokens=6, accepted_tokens=3, verify_steps=2)
    return acceptance_bench.Timed(rate, [("greedy", finish)] * len(token_ids), token_ids)


def test_ratios_per_round_and_the_tokens_compared_with_target_only() -> None:
    rounds = {
        "target_only": [timed(100.0, [[1, 2], [3, 4]]), timed(50.0, [[1, 2], [3, 4]])],
        "same": [timed(150.0, [[1, 2], [3, 4]]), timed(100.0, [[1, 2], [3, 4]])],
        "one_differs": [timed(120.0, [[1, 2], [3, 5]]), timed(60.0, [[1, 2], [3, 4]])],
    }
    report = acceptance_bench.speedup_report(rounds, repeats=2)
    assert report["same"]["speedup_runs"] == [1.5, 2.0]
    assert report["same"]["same_tokens_as_target_only"] == 1.0
    assert report["one_differs"]["speedup_runs"] == [1.2, 1.2]
    assert report["one_differs"]["same_tokens_as_target_only"] == 0.75  # 3 of the 4 requests over both rounds


def test_batch_one_runs_take_the_mix_in_turn_and_seeded_runs_repeat() -> None:
    """One prompt per group (batch 1): the requests take the mix's kinds in turn (not its first kind each), and a
    seeded run draws what the same run drew before; the target-only session's tokens for the same seeds are the
    speculative session's (argmax drafts, fp32 on the CPU)."""
    mix = [SamplingSettings(), SamplingSettings(1.0), SamplingSettings(1.0, top_k=5)]
    groups = [[p] for p in prompts(4, seed=3, longest=6).values()]
    session = spec_session("eagle3", 3)
    first = acceptance_bench.generate_groups(session, groups, 8, mix, ignore_eos=True)
    again = acceptance_bench.generate_groups(session, groups, 8, mix, ignore_eos=True)
    assert [kind for kind, _ in first.finishes] == ["greedy", "T1", "T1 top_k5", "greedy"]
    assert first.token_ids == again.token_ids and all(len(ids) == 8 for ids in first.token_ids)
    session.shutdown()
    target_only = tiny_session()
    assert acceptance_bench.generate_groups(target_only, groups, 8, mix, ignore_eos=True).token_ids == first.token_ids
    unseeded = acceptance_bench.generate_groups(target_only, groups, 8, mix, ignore_eos=True, seeded=False)
    assert unseeded.token_ids[0] == first.token_ids[0]  # greedy: the same whatever the seed
    assert unseeded.token_ids[1:3] != first.token_ids[1:3]  # sampled: 16 tokens drawn afresh
    target_only.shutdown()

"""bench/acceptance_bench.py's speedup report: ratios per round against the same round's target-only run, and the
share of requests whose tokens equal target-only's (seeded sampled runs with argmax drafts must emit its tokens)."""

from __future__ import annotations

import pytest

acceptance_bench = pytest.importorskip("acceptance_bench")

from executor_service.engine.request import Finish  # noqa: E402


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

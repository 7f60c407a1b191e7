"""`Finished.acceptance_rate_per_position[d - 1]` is the share of a request's verify steps whose accepted path
reached depth d (docs/api.md), so it never rises with depth. request.py divided by the steps whose tree reached
depth d instead: a DFlash tree that went 7 deep once and accepted all of it printed `5: 0.12  6: 0.33  7: 1.00`."""

from __future__ import annotations

import itertools
import random

import pytest

from executor_service.engine.request import Request
from executor_service.sample.sampling import SamplingSettings


def request_with(steps: list[tuple[int, int, int]]) -> Request:
    """A request whose verify steps were (drafts, accepted, depth) in turn."""
    request = Request("r", [1, 2], SamplingSettings(), 8, frozenset(), sink=lambda output: None)
    for drafts, accepted, depth in steps:
        request.record_verification(drafts, accepted, positions=depth)
    return request


def test_tree_rates_are_shares_of_every_verify_step() -> None:
    # Four steps: a shallow tree (depth 3, 1 accepted), two of depth 5 (5 and 2 accepted), one of depth 7 (all 7).
    finish = request_with([(8, 1, 3), (16, 5, 5), (16, 2, 5), (16, 7, 7)]).finish("length")
    assert finish.acceptance_per_position == pytest.approx([1.0, 0.75, 0.5, 0.5, 0.5, 0.25, 0.25])
    assert finish.verify_steps == 4


def test_chain_rates_with_shorter_last_steps() -> None:
    # A chain of 4, then one of 2 (near max_tokens) that accepted both: depth 3 and 4 were not reached there.
    finish = request_with([(4, 4, 4), (4, 1, 4), (2, 2, 2)]).finish("length")
    assert finish.acceptance_per_position == pytest.approx([1.0, 2 / 3, 1 / 3, 1 / 3])


@pytest.mark.parametrize("seed", range(20))
def test_rates_never_rise_with_depth(seed: int) -> None:
    rng = random.Random(seed)
    steps = []
    for _ in range(rng.randint(1, 12)):
        depth = rng.randint(1, 8)
        steps.append((depth * 2, rng.randint(0, depth), depth))
    rates = request_with(steps).finish("stop").acceptance_per_position
    assert all(later <= earlier for earlier, later in itertools.pairwise(rates)), rates
    assert all(0.0 <= rate <= 1.0 for rate in rates)

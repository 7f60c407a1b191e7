"""bench/adaptive_replay.py: a recorded trace's positions, the fixed k replayed exactly, and the real cost model
driven over traces where drafting always wins or never does."""

from __future__ import annotations

import pytest

adaptive_replay = pytest.importorskip("adaptive_replay")

PRICES = {b: {0: 1.0, 3: 1.5} for b in (1, 2, 4)}  # ms a step by bucket and k: a k = 3 step costs 1.5 decode steps


def test_each_position_takes_the_accepted_count_of_the_step_covering_it() -> None:
    replayed = adaptive_replay.Replayed.of("r", [2, 0, 3], max_tokens=10)
    assert replayed.accepted_at == [2, 2, 2, 0, 3, 3, 3, 3, 0, 0]


def test_the_fixed_k_replays_its_trace_exactly() -> None:
    """Every step at k = 3 accepting all three: 4 tokens a step, 16 steps for 64 tokens, at 1.5 ms each."""
    trace = [{"kind": "greedy", "accepted": [3] * 16}] * 2
    found = adaptive_replay.simulate(trace, PRICES, 3, 64, 2, "fixed", [0, 3])
    assert found["chosen_k_steps"] == {0: 0, 3: 16}
    assert found["tokens_per_s"] == pytest.approx(128 / 0.024)
    target = adaptive_replay.simulate(trace, PRICES, 3, 64, 2, "target", [0, 3])
    assert target["tokens_per_s"] == pytest.approx(128 / 0.064)


@pytest.mark.parametrize("accepted", [3, 0])
def test_the_cost_model_follows_the_trace(accepted: int) -> None:
    """Drafts always right: adaptive drafts nearly every step and matches the fixed k; never right: it ends at
    k = 0 (or releases the drafter) and beats the fixed k."""
    trace = [{"kind": "greedy", "accepted": [accepted] * 256}] * 4
    fixed = adaptive_replay.simulate(trace, PRICES, 3, 256, 1, "fixed", [0, 3])
    adaptive = adaptive_replay.simulate(trace, PRICES, 3, 256, 1, "adaptive", [0, 3])
    ratio = adaptive["tokens_per_s"] / fixed["tokens_per_s"]
    if accepted:
        assert ratio > 0.97
    else:
        assert ratio > 1.3 and adaptive["chosen_k_steps"][0] > 0.9 * sum(adaptive["chosen_k_steps"].values())


def test_stalls_are_the_same_moments_whatever_asks() -> None:
    """Drawn over simulated time from the seed: the same moments in whatever order they are asked (every policy
    meets the same machine), about length / every of the time, none without `every_ms`."""
    times = [t * 0.5 for t in range(2000)]
    forward = [adaptive_replay.Stalls(10, 2, 1.5, seed=3).factor_at(t) for t in times]
    backward = adaptive_replay.Stalls(10, 2, 1.5, seed=3)
    assert forward == [backward.factor_at(t) for t in reversed(times)][::-1]
    assert 0.1 < forward.count(1.5) / len(forward) < 0.3
    assert adaptive_replay.parse_stalls("none").factor_at(5.0) == 1.0
    assert adaptive_replay.parse_stalls("10,2,1.5,3").seed == 3


def test_batch_1_runs_the_penalised_requests_first_too() -> None:
    """acceptance_bench's 15 prompts alone (the 16th place left out), and for a mix with penalised requests also
    those first; at a larger batch all of them together."""
    trace = [{"kind": kind, "accepted": [i]} for i, kind in enumerate(["greedy"] * 12 + ["rep1.2"] * 2 + ["x"] * 2)]
    found = adaptive_replay.orders(trace, 1)
    assert found["batch_1"] == trace[:15]
    assert [e["kind"] for e in found["batch_1_penalised_first"]][:3] == ["rep1.2", "rep1.2", "greedy"]
    assert sorted(e["accepted"][0] for e in found["batch_1_penalised_first"]) == list(range(15)) and len(found) == 2
    assert adaptive_replay.orders(trace, 16) == {"batch_16": trace}
    assert list(adaptive_replay.orders(trace[:12] + trace[14:], 1)) == ["batch_1"]


def test_timed_rounds_meet_their_own_stalls() -> None:
    """--rounds: passes in a row over one AdaptiveK (as acceptance_bench's rounds share a session), each meeting the
    machine's slow moments of its own seed: the figures are the median round's, with every round's choices."""
    trace = [{"kind": "greedy", "accepted": [1, 0, 2, 0] * 64}] * 4
    stalls = adaptive_replay.Stalls(5, 2, 3.0)
    found = adaptive_replay.simulate(trace, PRICES, 3, 256, 1, "adaptive", [0, 3], stalls, rounds=3)
    assert len(found["rounds"]) == 3 and found["chosen_k_steps"] in found["rounds"]
    assert found["rounds"][0] != found["rounds"][1], found["rounds"]  # other moments, other choices
    one = adaptive_replay.simulate(trace, PRICES, 3, 256, 1, "adaptive", [0, 3], stalls)
    assert one["chosen_k_steps"] == found["rounds"][0]  # the first round as a run of one

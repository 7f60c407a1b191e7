"""Device-resident steps launched blind: when a greedy batch goes on unchanged, the engine launches the step after
the current one before reading the current one back (spec_step.launch_following), its inputs derived on the
device from the accepted counts. These tests check that the derived inputs are the ones the host would build
after booking, that outputs stay the target's own, and that aborts and finishes while a step is in flight
leave nothing behind."""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import Collector
from greedy_reference import greedy_reference
from spec_builders import spec_session

from executor_service.engine.request import Request, Status
from executor_service.engine.scheduler import ScheduledStep
from executor_service.sample.sampling import SamplingSettings

K = 4
METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def prompts(count: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(500) for _ in range(rng.randint(3, 40))] for i in range(count)}


@pytest.mark.parametrize("method", METHODS)
def test_outputs_are_the_targets_own_with_following_steps(method: str) -> None:
    session = spec_session(method, K)
    batch, sink = prompts(5), Collector()
    for rid, prompt in batch.items():
        max_tokens = 20 + 3 * int(rid[1:])  # requests finish at different steps, some while a step is in flight
        session.engine.add(session.new_request(rid, prompt, SamplingSettings(), max_tokens, sink))
    session.engine.run_until_idle()
    assert session.engine.spec_step is not None and session.engine.spec_step.counts["eager following"] > 0
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 20 + 3 * int(rid[1:])), rid
        assert sink.finish_reason(rid) == "length"
    assert session.kv_cache.allocator.num_used == 0


def test_following_inputs_are_what_the_host_builds_after_booking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any accepted counts (forced here, 0..k across the batch, changing every step): the following step's
    tokens, positions, slots, sequence lengths and slots ahead equal the ones runner.prepare and the proposer
    build from the requests once the step before is booked."""
    session = spec_session("eagle3", K)
    spec_step, engine, rows = session.engine.spec_step, session.engine, K + 1
    assert spec_step is not None
    forward, launch_following = spec_step.forward, spec_step.launch_following
    launched: list[tuple[list[Request], dict[str, torch.Tensor]]] = []
    calls = {"forward": None}

    def recording_forward(step, positions, x, variant):  # type: ignore[no-untyped-def]
        metadata = {"positions": positions, "seq_lens": step.seq_lens, "slot_mapping": step.slot_mapping}
        calls["forward"] = {name: tensor.clone() for name, tensor in (metadata | x).items()}
        return forward(step, positions, x, variant)

    def forced_following(previous, requests):  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            previous.packed[:, rows] = torch.tensor([(len(launched) + i) % rows for i in range(len(requests))])
        pending = launch_following(previous, requests)
        launched.append((requests, calls["forward"]))
        return pending

    monkeypatch.setattr(spec_step, "forward", recording_forward)
    monkeypatch.setattr(spec_step, "launch_following", forced_following)
    for rid, prompt in prompts(3, seed=4).items():
        engine.add(session.new_request(rid, prompt, SamplingSettings(), 60, Collector()))
    engine._drain_commands()
    checked = 0
    while engine._has_work() and checked < 6:
        before = len(launched)
        engine.step()
        if len(launched) == before:
            continue
        requests, derived = launched[-1]
        if any(r.status is not Status.RUNNING for r in requests):
            continue
        built = session.engine.runner.prepare(ScheduledStep(list(requests), [rows] * len(requests)))
        starts = [r.num_computed_tokens for r in requests]
        assert derived["input_ids"].tolist() == built.input_ids.tolist()
        assert derived["positions"].tolist() == built.positions.tolist()
        assert derived["slot_mapping"].tolist() == built.attention.slot_mapping.tolist()
        assert derived["seq_lens"].tolist() == built.attention.seq_lens.tolist()
        assert session.proposer is not None
        expected_ahead = session.proposer.slots_ahead(requests, starts, session.proposer.ahead_width)
        assert derived["slots_ahead"].tolist() == expected_ahead.tolist()
        checked += 1
    assert checked >= 3


def test_an_abort_while_a_step_is_in_flight() -> None:
    session = spec_session("dflash", K)
    engine, batch, sink = session.engine, prompts(3, seed=2), Collector()
    for rid, prompt in batch.items():
        engine.add(session.new_request(rid, prompt, SamplingSettings(), 40, sink))
    engine._drain_commands()
    while engine._in_flight is None:
        engine.step()
    assert engine.abort(["r1"]) == ["r1"]
    engine.run_until_idle()
    assert sink.finish_reason("r1") == "abort"
    for rid in ("r0", "r2"):
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, batch[rid], 40)
    assert engine._in_flight is None and session.kv_cache.allocator.num_used == 0
    assert not engine.live_ids()

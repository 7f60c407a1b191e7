"""A request arriving while others verify on the device step: its prefill runs on the host path beside the
device step, in the same engine step, and the running requests stay on the device step (step_parts.py). Greedy
tokens stay target-only's; a seeded sampled request emits the same tokens whether the step is split or demoted
to the host path; the negative control (no split) demotes the batch."""

from __future__ import annotations

import pytest
from engine_driving import Collector
from greedy_reference import greedy_reference
from spec_builders import spec_session
from spec_checks import assert_no_leak, prompts

import executor_service.engine.engine as engine_module
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

GREEDY = SamplingSettings(ignore_eos=True)
SEEDED = SamplingSettings(temperature=0.8, seed=17, ignore_eos=True)


def run_with_arrival(method: str) -> tuple[ModelSession, Collector, dict[str, list[int]]]:
    """Two requests (greedy, seeded sampled) reach the device step, then a third arrives mid-run."""
    session = spec_session(method, 3, max_num_batched_tokens=128)
    batch, sink = prompts(3, seed=21, longest=24), Collector()
    engine = session.engine
    engine.add(session.new_request("r0", batch["r0"], GREEDY, 24, sink))
    engine.add(session.new_request("r1", batch["r1"], SEEDED, 24, sink))
    engine._drain_commands()
    for _ in range(40):
        engine.step()
        if engine.step_counts["device"] >= 2:
            break
    assert engine.step_counts["device"] >= 2, engine.step_counts
    engine.add(session.new_request("r2", batch["r2"], GREEDY, 24, sink))
    engine.run_until_idle()
    assert_no_leak(session)
    return session, sink, batch


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_an_arrival_prefills_beside_the_device_step(method: str) -> None:
    session, sink, batch = run_with_arrival(method)
    counts = session.engine.step_counts
    assert counts["device beside host"] >= 1, counts
    assert counts["host drafts"] == 0, counts  # no running request's drafts were verified on the host path
    for rid in ("r0", "r2"):
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, batch[rid], 24), rid
    assert len(sink.tokens("r1")) == 24


def test_without_the_split_the_batch_is_demoted_with_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the whole step on the host path verifies the running requests' drafts there; the
    seeded sampled request's tokens are the same either way (both paths draw the same numbers)."""
    _, split_sink, _ = run_with_arrival("eagle3")
    monkeypatch.setattr(engine_module, "split_for_device", lambda scheduled, rows, takes: None)
    session, sink, _ = run_with_arrival("eagle3")
    counts = session.engine.step_counts
    assert counts["device beside host"] == 0 and counts["host drafts"] > 0, counts
    assert {r: sink.tokens(r) for r in ("r0", "r1", "r2")} == {r: split_sink.tokens(r) for r in ("r0", "r1", "r2")}

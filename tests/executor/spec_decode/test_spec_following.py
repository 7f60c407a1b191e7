"""Device-resident steps launched blind: when a greedy batch goes on unchanged, the engine launches the step after
the current one before reading the current one back (spec_step.launch_following), its inputs derived on the
device from the accepted counts. These tests check that the derived inputs are the ones the host would build
after booking, that outputs stay the target's own, and that aborts and finishes while a step is in flight
leave nothing behind."""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import Collector, Outputs
from following_cases import MIXED, finishing_prompts, logprobs, serve_finishing_apart
from greedy_reference import greedy_reference
from spec_builders import EchoDrafts, spec_session
from tree_cases import TREES, tree_session

from executor_service.engine.request import Request, Status
from executor_service.engine.scheduler import ScheduledStep
from executor_service.models.weights import echoing_target
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

    def forced_following(previous, requests, kept=None):  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            previous.packed[:, rows] = torch.tensor([(len(launched) + i) % rows for i in range(len(previous.packed))])
        pending = launch_following(previous, requests, kept)
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


@pytest.mark.parametrize(
    ("method", "sampled_drafts", "graphs"),
    [
        ("eagle3", "off", False),
        ("eagle3", "on", False),
        ("dflash", "off", False),
        ("eagle3", "on", True),
        ("eagle3 tree", "off", False),
        ("dflash tree", "off", True),
    ],
)
def test_finished_requests_are_left_out_of_the_step_launched_after_them(
    method: str, sampled_drafts: str, graphs: bool
) -> None:
    """Requests finishing apart in a batch mixing greedy, sampled, penalised and logprob requests (and drafts drawn
    from q): the step launched after a finish goes on for those still running (their packed rows, positions,
    sampling inputs, penalty slots and q gathered on the device), so only the first device step is launched from
    the host; every token, logprob and acceptance count is the control's, where each finish makes the host launch
    the next step afresh (one more host launch per finish), and greedy requests' tokens are the target's own.
    `graphs`: the device step's stand-in graphs (the narrowed batch replays a smaller bucket). Trees: a dynamic
    one (its parents in the packed rows)."""
    tree, depth = TREES["dynamic_3_budget_8_depth_4"]
    sessions = [
        tree_session(method.split()[0], tree, depth) if method.endswith(" tree")
        else spec_session(method, K, sampled_drafts=sampled_drafts)
        for _ in range(2)
    ]  # fmt: skip
    for session in sessions if graphs else []:
        assert session.engine.spec_step is not None
        session.engine.spec_step.capture_graphs(8, session.loaded.model.config.max_position_embeddings)
    narrowed, control = sessions
    outputs, fresh = serve_finishing_apart(narrowed, narrow=True)
    expected, control_fresh = serve_finishing_apart(control, narrow=False)
    if graphs:
        assert narrowed.engine.spec_step is not None and narrowed.engine.spec_step.counts["graph following"] > 0
    batch = finishing_prompts()
    for index, rid in enumerate(batch):
        assert outputs.tokens(rid) == expected.tokens(rid), rid
        assert logprobs(outputs, rid) == logprobs(expected, rid), rid
        assert len(outputs.tokens(rid)) == 12 + 7 * index, rid
    assert outputs.tokens("r0") == greedy_reference(narrowed.loaded.model, batch["r0"], 12)
    assert outputs.acceptance() == expected.acceptance()
    # The batch's first device steps come from the host (the first beside the others' prefill); after that every
    # finish but the last cost the control a host launch, and none here.
    assert fresh <= 2 and control_fresh - fresh == len(MIXED) - 1, (fresh, control_fresh)
    counts = [session.engine.spec_step.counts["narrowed"] for session in sessions if session.engine.spec_step]
    assert counts[0] == len(MIXED) - 1 and counts[1] == 0, counts  # a narrowed launch for each finish but the last
    assert narrowed.kv_cache.allocator.num_used == 0 and not narrowed.engine.live_ids()


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


@pytest.mark.parametrize("on_device", [True, False])
def test_always_right_drafts_on_the_device_launch_ahead(on_device: bool) -> None:
    """Benchmarks' always-right drafter (an echoing target, drafts of its newest token): written for the device step
    too (Proposer.device_replay), its steps launch ahead as a drafter's do and every draft is accepted; scripted on
    the host alone (the control), no step launches ahead."""
    session = spec_session("eagle3", K)
    echoing_target(session.loaded.model)
    assert session.proposer is not None and session.engine.spec_step is not None
    if on_device:
        EchoDrafts().install(session.proposer)
    else:
        session.proposer.replay = EchoDrafts()
    counts = session.engine.spec_step.counts
    launched_ahead = counts["eager following"]  # the warm-up's
    batch, sink = prompts(3, seed=5), Outputs()
    for rid, prompt in batch.items():
        session.engine.add(session.new_request(rid, prompt, SamplingSettings(), 30, sink))
    session.engine.run_until_idle()
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 30), rid
        assert set(sink.tokens(rid)) == {prompt[-1]}  # the target echoed throughout
    assert (counts["eager following"] > launched_ahead) is on_device, counts
    verified = sink.acceptance()
    assert verified["drafted"] > 0 and verified["accepted"] == verified["drafted"], verified  # always right


def test_graphs_replay_only_the_device_replay_they_captured() -> None:
    """A device step's graphs captured without a device rule do not replay once one is set (they would drop it):
    the step runs eagerly until graphs are captured with it."""
    session = spec_session("eagle3", K)
    spec_step, proposer = session.engine.spec_step, session.proposer
    assert spec_step is not None and proposer is not None
    spec_step.capture_graphs(4, session.loaded.model.config.max_position_embeddings)  # the CPU's stand-in graphs
    graphs = spec_step.graphs["greedy"]
    assert spec_step.replays("greedy", graphs)
    EchoDrafts().install(proposer)
    assert not spec_step.replays("greedy", graphs)
    spec_step.capture_graphs(4, session.loaded.model.config.max_position_embeddings)
    assert spec_step.replays("greedy", spec_step.graphs["greedy"])


def test_an_abort_while_a_narrowed_step_is_in_flight() -> None:
    """A request finishes, the step after it goes on for the others (narrowed), and an abort arrives while that
    step is in flight: the aborted request is dropped, the others' tokens are the target's own, nothing leaks."""
    session = spec_session("eagle3", K)
    engine, spec_step, batch, sink = session.engine, session.engine.spec_step, prompts(3, seed=6), Collector()
    assert spec_step is not None
    launch_following, narrowed = spec_step.launch_following, []

    def recording(previous, requests, kept=None):  # type: ignore[no-untyped-def]
        narrowed.append(kept is not None)
        return launch_following(previous, requests, kept)

    spec_step.launch_following = recording  # type: ignore[method-assign]
    lengths = {"r0": 6, "r1": 60, "r2": 60}
    for rid, prompt in batch.items():
        engine.add(session.new_request(rid, prompt, SamplingSettings(), lengths[rid], sink))
    engine._drain_commands()
    while not any(narrowed) and engine._has_work():
        engine.step()
    assert any(narrowed) and engine._in_flight is not None and sink.finish_reason("r0") == "length"
    assert engine.abort(["r1"]) == ["r1"]
    engine.run_until_idle()
    assert sink.finish_reason("r1") == "abort"
    for rid in ("r0", "r2"):
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, batch[rid], lengths[rid]), rid
    assert engine._in_flight is None and session.kv_cache.allocator.num_used == 0 and not engine.live_ids()

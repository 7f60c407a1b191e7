"""The drafter's context held through steps without drafting (deferred_context.py), fp32 on the CPU: a step that
plans k = 0 runs no drafter pass but the bounded flushes; when drafting resumes, the drafts and the drafter's K/V
of every computed position equal those of a drafter that ran its context pass every step (EAGLE-1, EAGLE-3 and
DFlash, chains and trees, k = 0 stretches shorter and longer than DEFER_MAX). Negative control: one held row
lost shows in the K/V. Finish, abort and preemption leave nothing held, and adaptive speculation prices a flush
where it belongs (k = 0's when the rows reached their bound, no k's at a switch)."""

from __future__ import annotations

import pytest
import torch
from deferred_runs import BATCH, K, run, session_for
from engine_driving import Collector, add_all
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import ReplayDrafts, Scripted, spec_session
from spec_checks import assert_no_leak

from executor_service.engine.request import Request
from executor_service.engine.scheduler import ScheduledStep
from executor_service.server.session import ModelSession
from executor_service.spec_decode.deferred_context import DEFER_MAX, DeferredContext

CASES = [(m, False) for m in ("eagle", "eagle3", "dflash")] + [(m, True) for m in ("eagle3", "dflash")]


@pytest.mark.parametrize("device_step", [True, False])
@pytest.mark.parametrize("stretch", [5, 2 * DEFER_MAX + 3])
@pytest.mark.parametrize(("method", "tree"), CASES)
def test_drafts_and_drafter_cache_equal_the_per_step_context_pass(
    method: str, tree: bool, stretch: int, device_step: bool
) -> None:
    """On the device step a k = 0 stretch starts after the device step drafted (its pass inside it); on the host
    path the first k = 0 step holds the verified rows of the last verify step."""
    max_tokens = 2 * stretch + 12
    held, every_step = session_for(method, tree, device_step), session_for(method, tree, device_step)
    on, off = run(held, stretch, max_tokens), run(every_step, stretch, max_tokens, defer=False)
    model = held.loaded.model
    for rid, prompt in BATCH.items():
        assert on.sink.tokens(rid) == off.sink.tokens(rid) == greedy_reference(model, prompt, max_tokens), rid
    assert on.drafts == off.drafts  # the same drafts at every step, trees' parents too
    assert sum(bool(ids) for step in on.drafts for ids, _ in step.values()) > 10
    compared = [i for i in on.caches if on.caches[i]]
    assert len(compared) > 5
    for index in compared:
        for rid, cache in on.caches[index].items():
            torch.testing.assert_close(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)
    # No k = 0 step of the host path ran the drafter but the flushes at the bound (a device step that verified the
    # last drafts drafts inside it, as its graph does); without deferral every such step ran its context pass.
    zero = [(flushed, ran) for planned, flushed, device, ran in on.steps if planned == 0 and not device]
    assert len(zero) >= stretch
    assert all(not ran for flushed, ran in zero if not flushed), zero
    assert all(ran for planned, _, device, ran in off.steps if planned == 0 and not device)
    counts = held.engine.deferred.counts  # type: ignore[union-attr]
    bound_flushes = sum(flushed for flushed, _ in zero)
    assert counts["flushes at k = 0"] == bound_flushes and counts["flushes to draft"] > 0
    if stretch > DEFER_MAX:  # about one flush per DEFER_MAX steps of a stretch
        assert 1 <= bound_flushes <= 3 * -(-stretch // (DEFER_MAX - K - 1)), counts
    else:  # the prompts were held too, and the stretch ended before the bound
        assert bound_flushes == 0 and counts["deferred steps"] > 0
    assert 0 < on.most_held <= DEFER_MAX
    for session in (held, every_step):
        assert_no_leak(session)
    assert not held.engine.deferred.held and held.engine.deferred.filled == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(("method", "tree"), CASES)
def test_overlapped_k0_steps_hold_what_serial_steps_hold(method: str, tree: bool) -> None:
    """k = 0 decode steps overlapped (the step after each launched before its read-back, its feature rows staged in
    the log first): the same tokens, drafts and drafter K/V as every step serially, and the flushes at the bound
    break the chain for a step (the held rows run from that step's own features)."""
    stretch, max_tokens = 2 * DEFER_MAX + 3, 2 * (2 * DEFER_MAX + 3) + 12
    overlapped, serial = session_for(method, tree), session_for(method, tree)
    on, off = run(overlapped, stretch, max_tokens), run(serial, stretch, max_tokens, overlap=False)
    for rid in BATCH:
        assert on.sink.tokens(rid) == off.sink.tokens(rid), rid
    assert on.drafts == off.drafts
    compared = [i for i in on.caches if on.caches[i] and i in off.caches]
    assert len(compared) > 5
    for index in compared:
        for rid, cache in on.caches[index].items():
            torch.testing.assert_close(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)
    counts, serial_counts = overlapped.engine.step_counts, serial.engine.step_counts
    assert counts["overlapped decode"] > stretch and serial_counts["overlapped decode"] == 0
    deferred = overlapped.engine.deferred
    assert deferred is not None and deferred.counts["flushes at k = 0"] >= 2
    for session in (overlapped, serial):
        assert_no_leak(session)


def test_a_misplaced_staged_row_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the test above: staged rows in the wrong order (each request's row where another's went)
    leave a different drafter K/V."""
    stage = DeferredContext.stage

    def reversed_rows(self: DeferredContext, requests: list[Request], features: torch.Tensor) -> int | None:
        return stage(self, requests, features[: len(requests)].flip(0))

    monkeypatch.setattr(DeferredContext, "stage", reversed_rows)
    stretch, max_tokens = 2 * DEFER_MAX + 3, 2 * (2 * DEFER_MAX + 3) + 12
    on = run(session_for("eagle3", False), stretch, max_tokens)
    monkeypatch.undo()
    off = run(session_for("eagle3", False), stretch, max_tokens, overlap=False)
    differs = [
        index
        for index, caches in on.caches.items()
        for rid, cache in caches.items()
        if index in off.caches and not torch.allclose(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)
    ]
    assert differs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("method", "tree"), [("eagle3", False), ("dflash", False), ("eagle3", True)])
def test_held_rows_are_copies_of_the_graphs_features(method: str, tree: bool) -> None:
    """On the GPU a k = 0 step replays the target's decode graph, whose features sit in static buffers that the
    next replay overwrites: the held rows are copies, so the drafts and the drafter's K/V still equal the per-step
    context pass's (fp32, Triton kernels, CUDA graphs)."""
    stretch, max_tokens = 2 * DEFER_MAX + 3, 60
    on = run(session_for(method, tree, device="cuda"), stretch, max_tokens)
    off = run(session_for(method, tree, device="cuda"), stretch, max_tokens, defer=False)
    for rid in BATCH:
        assert on.sink.tokens(rid) == off.sink.tokens(rid), rid
    assert on.drafts == off.drafts
    compared = [i for i in on.caches if on.caches[i]]
    assert len(compared) > 5
    for index in compared:
        for rid, cache in on.caches[index].items():
            torch.testing.assert_close(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_accepted_rows_are_held_and_run_in_order(method: str) -> None:
    """Drafts that are the target's own tokens (the third one wrong: two accepted a step) on the host path: the
    first k = 0 step after a verify step holds its three verified rows, and the K/V after each flush equals the
    per-step context pass's."""
    stretch, max_tokens = 2 * DEFER_MAX + 3, 90
    traces = []
    for defer in (True, False):
        session = session_for(method, False, device_step=False)
        model = session.loaded.model
        reference = {rid: greedy_reference(model, prompt, max_tokens + K + 1) for rid, prompt in BATCH.items()}
        session.proposer.replay = ReplayDrafts(reference, model.config.vocab_size, wrong_at=2)  # type: ignore[union-attr]
        traces.append(run(session, stretch, max_tokens, defer=defer))
        assert_no_leak(session)
    on, off = traces
    for rid in BATCH:
        assert on.sink.tokens(rid) == off.sink.tokens(rid), rid
    compared = [i for i in on.caches if on.caches[i]]
    assert len(compared) > 5
    for index in compared:
        for rid, cache in on.caches[index].items():
            torch.testing.assert_close(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)


def test_a_lost_held_row_shows() -> None:
    """Negative control: one held row's features lost before its flush leave a different drafter K/V."""
    stretch, max_tokens = 6, 16
    on = run(session_for("eagle3", False), stretch, max_tokens, lose_a_row=True)
    off = run(session_for("eagle3", False), stretch, max_tokens, defer=False)
    differs = [
        index
        for index, caches in on.caches.items()
        for rid, cache in caches.items()
        if not torch.allclose(cache, off.caches[index][rid], rtol=1e-4, atol=1e-5)
    ]
    assert differs


def held_session(method: str = "eagle3", **kwargs: int) -> ModelSession:
    session = spec_session(method, K, max_num_batched_tokens=128, **kwargs)
    session.engine.speculation = Scripted([0], [0, K])
    return session


def test_finish_and_abort_leave_nothing_held() -> None:
    session = held_session()
    engine = session.engine
    deferred = engine.deferred
    assert deferred is not None
    sink = Collector()
    add_all(session, {**BATCH, "long": list(range(1, 6))}, greedy(40), sink)
    engine._drain_commands()
    for _ in range(4):
        engine.step()
    assert set(deferred.held) == {*BATCH, "long"} and deferred.rows > 0
    assert engine.abort(["b"]) == ["b"]
    engine._drain_commands()
    assert "b" not in deferred.held
    engine.run_until_idle()
    assert sink.finish_reason("b") == "abort" and sink.finish_reason("long") == "length"
    assert not deferred.held and deferred.filled == 0
    assert_no_leak(session)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_preemption_drops_held_rows_and_the_drafts_stay_the_same(method: str) -> None:
    """A cache too small for the batch: requests preempted while they hold rows are computed again from their
    tokens, and every draft from a state both runs proposed in is the same with deferral on and off."""
    batch = {f"r{i}": [(7 * i + j) % 500 + 1 for j in range(12 + 2 * i)] for i in range(4)}
    runs = []
    for defer in (True, False):
        session = held_session(method, num_kv_blocks=10)
        engine = session.engine
        engine.speculation = Scripted([0] * 9 + [K] * 3, [0, K])
        if not defer:
            engine.deferred = None
        drafts: dict[tuple[str, int, int], list[int]] = {}

        def record(request: Request, ids: list[int], into: dict = drafts) -> list[int]:
            into[request.request_id, request.num_tokens, request.num_computed_tokens] = list(ids)
            return ids

        session.proposer.replay = record  # type: ignore[union-attr]
        dropped: list[int] = []
        schedule = engine.scheduler.schedule

        def scheduling(engine=engine, schedule=schedule, dropped=dropped) -> ScheduledStep:  # type: ignore[no-untyped-def]
            held = dict(engine.deferred.held) if engine.deferred is not None else {}
            step = schedule()
            dropped.extend(held[r.request_id].rows for r in step.preempted if r.request_id in held)
            return step

        engine.scheduler.schedule = scheduling  # type: ignore[method-assign]
        sink = Collector()
        add_all(session, batch, greedy(40), sink)
        engine.run_until_idle()
        for rid, prompt in batch.items():
            assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 40), rid
        assert_no_leak(session)
        if defer:
            assert dropped and engine.deferred is not None and not engine.deferred.held
        runs.append(drafts)
    on, off = runs
    common = on.keys() & off.keys()
    assert len(common) > 20
    assert all(on[state] == off[state] for state in common)


def test_a_long_prefill_chunk_at_k0_flushes_every_held_row() -> None:
    """A prompt chunk longer than DEFER_MAX is not held: it runs at once, and every held row with it (one pass),
    so the bounds of the requests fall together afterwards."""
    session = held_session()
    engine = session.engine
    deferred = engine.deferred
    assert deferred is not None and session.proposer is not None
    add_all(session, {"short": [1, 2, 3]}, greedy(30), Collector())
    engine._drain_commands()
    for _ in range(3):
        engine.step()
    assert deferred.held["short"].rows == 5
    passes = sum(session.proposer.pass_counts.values())
    add_all(session, {"long": list(range(1, DEFER_MAX + 10))}, greedy(4), Collector())
    engine._drain_commands()
    while engine._decoding is not None:  # a decode step launched before "long" came (overlap_decode.py): booked first
        engine.step()
    held_steps = deferred.steps  # three, or four with the overlapped one
    engine.step()
    assert engine._flushed == (True, held_steps + 1)  # at k = 0: the held steps and this one
    assert sum(session.proposer.pass_counts.values()) == passes + 1 and not deferred.held
    assert deferred.counts["flushes at k = 0"] == 1
    engine.run_until_idle()


def test_a_flush_is_priced_where_it_belongs() -> None:
    """A flush at the bound: neither its step nor the next is a plain k = 0 sample; their time beyond two plain
    steps, over the k = 0 steps it served, is k = 0's surcharge. A flush where drafting resumes: neither step
    priced (the switch's)."""
    session = held_session()
    engine = session.engine
    speculation = Scripted([0] * (2 * DEFER_MAX + 4) + [K] * 4, [0, K])
    engine.speculation = speculation
    calls: list[tuple[str, int, int]] = []
    record, record_deferred = speculation.record, speculation.record_deferred

    def recording(batch: int, k: int, seconds: float) -> None:
        calls.append(("record", k, 0))
        record(batch, k, seconds)

    def recording_deferred(batch: int, seconds: float, steps: int, landed: int) -> None:
        calls.append(("deferred", steps, landed))
        record_deferred(batch, seconds, steps, landed)

    speculation.record, speculation.record_deferred = recording, recording_deferred  # type: ignore[method-assign]
    add_all(session, {"a": [1, 2, 3, 4], "b": [9, 8, 7]}, greedy(2 * DEFER_MAX + 12), Collector())
    engine._drain_commands()
    flushes: list[tuple[int, tuple[bool, int]]] = []
    steps: list[list[tuple[str, int, int]]] = []
    for _ in range(2 * DEFER_MAX + 10):
        before = len(calls)
        engine.step()
        steps.append(calls[before:])
        if engine._flushed is not None:
            flushes.append((len(steps) - 1, engine._flushed))
    at_zero = [(i, served) for i, (zero, served) in flushes if zero]
    to_draft = [i for i, (zero, _) in flushes if not zero]
    assert len(at_zero) >= 2 and len(to_draft) == 1
    for index, served in at_zero:
        assert steps[index] == []  # the flush's own step: no sample
        assert steps[index + 1] == [("deferred", served, 2)]  # the step after: the surcharge
        assert served <= DEFER_MAX + 1  # DEFER_MAX steps held, then the one that runs them with its own row
    assert steps[to_draft[0]] == steps[to_draft[0] + 1] == []
    cost = speculation.costs[speculation.bucket(2)][0]
    assert len(cost.surcharges) == len(at_zero) - 1  # the first flush is a warm-up (it compiles)
    assert cost.seconds >= cost.plain and cost.recent
    engine.run_until_idle()


@pytest.mark.parametrize(("method", "tree", "device_step"), [("eagle3", False, True), ("dflash", True, False)])
def test_k0_steps_with_penalties_and_logprobs_match_serial(method: str, tree: bool, device_step: bool) -> None:
    """Penalised requests asking for logprobs through k = 0 stretches (overlapped, the decode overlap's penalty
    table) and drafting steps (the device step's table, or the host path's counts): the same tokens, logprobs and
    drafts as every step serially."""
    stretch, max_tokens = 2 * DEFER_MAX + 3, 2 * (2 * DEFER_MAX + 3) + 12
    settings = greedy(max_tokens, frequency_penalty=0.3, repetition_penalty=1.2, logprobs=1)
    traces, sessions = [], []
    for overlap in (True, False):
        session = session_for(method, tree, device_step)
        engine, proposer = session.engine, session.proposer
        assert proposer is not None
        engine.overlap_decode = overlap
        engine.speculation = Scripted([0] * stretch + [proposer.num_draft_tokens] * 4, [0, proposer.num_draft_tokens])
        sink = Collector()
        add_all(session, BATCH, settings, sink)
        engine._drain_commands()
        while engine._has_work():
            engine.step()
        engine._flush_outbox()
        traces.append(sink)
        sessions.append(session)
    on, off = traces
    for rid in BATCH:
        assert on.tokens(rid) == off.tokens(rid), rid
        assert [o.logprobs for o in on.outputs[rid]] == [o.logprobs for o in off.outputs[rid]], rid
    counts = sessions[0].engine.step_counts
    assert counts["overlapped decode"] > stretch and sessions[1].engine.step_counts["overlapped decode"] == 0
    assert counts["device"] > 0 or not device_step, counts
    for session in sessions:
        assert_no_leak(session)

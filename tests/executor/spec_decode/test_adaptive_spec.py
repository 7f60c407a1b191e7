"""Adaptive speculation in the engine (CPU): greedy tokens equal target-only while k switches mid-request (none,
some, all drafts; chains on the device step and the host path, EAGLE-1 / EAGLE-3 / DFlash, and trees), the
drafter's cache follows every token through steps without drafting, and the chosen k reaches stats and metrics."""

from __future__ import annotations

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import greedy
from greedy_reference import greedy_reference
from prometheus_client import CollectorRegistry
from spec_builders import ReplayDrafts, Scripted, spec_session
from spec_checks import assert_no_leak, prompts
from tree_cases import tree_session

from executor_service.engine.request import Request
from executor_service.models.attention_step import cache_slot
from executor_service.server.metrics import EngineMetrics
from executor_service.server.session import ModelSession
from executor_service.spec_decode.proposer import ProposeBatch, Proposer
from specdec.v1 import common_pb2


def generate(session: ModelSession, batch: dict[str, list[int]], max_tokens: int) -> Collector:
    sink = Collector()
    add_all(session, batch, greedy(max_tokens), sink)
    session.engine.run_until_idle()
    return sink


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_chain_greedy_equals_target_only_as_k_switches(method: str) -> None:
    k = 4
    session = spec_session(method, k, max_num_batched_tokens=128)
    cycle = [k, k, 0, 0, k, 2, 0, k, k, k, 1, 0, 3]
    session.engine.speculation = scripted = Scripted(cycle, list(range(k + 1)))
    batch = prompts(4, seed=3)
    sink = generate(session, batch, 20)
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 20), rid
    assert set(scripted.chosen) == set(cycle)
    assert session.engine.spec_step is not None and session.engine.spec_step.counts["eager"] > 0  # the device step
    assert_no_leak(session)


def replayed_verifications(method: str, wrong_at: int | None) -> list[tuple[int, int]]:
    """(drafts verified, drafts accepted) of each verified request of a batch whose drafter proposes the target's
    own next tokens (ReplayDrafts, the draft at `wrong_at` corrupted) while k switches as in the test above."""
    k = 4
    session = spec_session(method, k, max_num_batched_tokens=128)
    session.engine.speculation = scripted = Scripted([k, k, 0, 0, k, 2, 0, k, k, k, 1, 0, 3], list(range(k + 1)))
    verified: list[tuple[int, int]] = []
    observe = scripted.observe_verify

    def observing(request_ids: list[str], depths: list[int], accepted: list[int]) -> None:
        verified.extend(zip(depths, accepted, strict=True))
        observe(request_ids, depths, accepted)

    scripted.observe_verify = observing  # type: ignore[method-assign]
    batch = prompts(4, seed=3)
    model = session.loaded.model
    reference = {rid: greedy_reference(model, prompt, 40 + k + 1) for rid, prompt in batch.items()}  # no padding
    assert session.proposer is not None
    session.proposer.replay = ReplayDrafts(reference, model.config.vocab_size, wrong_at)
    sink = generate(session, batch, 40)
    for rid in batch:
        assert sink.tokens(rid) == reference[rid][:40], rid
    assert_no_leak(session)
    return verified


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_replayed_drafts_are_all_accepted_as_k_switches(method: str) -> None:
    """The engine side of the benchmark's always-right drafter: whatever k the steps before took (none, fewer), a
    step's drafts are the request's next tokens and the verification counts each one accepted. (The H100's
    collapse of that drafter under adaptive speculation was the bf16 target's tokens changing with the step's
    shape, not the engine: executor_service/models/weights.py, `echoing_target`.)"""
    verified = replayed_verifications(method, None)
    assert len(verified) > 20 and len({d for d, _ in verified}) >= 3  # the loaded k and fewer
    assert all(accepted == drafts for drafts, accepted in verified)


def test_the_replay_check_sees_a_wrong_draft() -> None:
    """Negative control: the replay with its third draft corrupted is seen accepting two where it verified more."""
    verified = replayed_verifications("eagle3", 2)
    assert any(drafts > 2 for drafts, _ in verified)
    assert all(accepted == min(drafts, 2) for drafts, accepted in verified)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_tree_greedy_equals_target_only_as_k_switches(method: str) -> None:
    tree = common_pb2.DraftTree(top_k=2, verify_budget=6)
    session = tree_session(method, tree, k=3)
    size = session.proposer.num_draft_tokens  # type: ignore[union-attr]
    cycle = [size, size, 0, size, 0, 0, size, 3]
    session.engine.speculation = Scripted(cycle, [0, size])
    batch = prompts(3, seed=5, vocab=256)
    sink = generate(session, batch, 16)
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 16), rid
    assert_no_leak(session)


def drafter_cache(session: ModelSession, request: Request, positions: int) -> torch.Tensor:
    """The drafter's K/V of the request's first `positions` positions, every layer."""
    proposer = session.proposer
    assert proposer is not None
    slots = [cache_slot(request.block_ids, p, proposer.block_size) for p in range(positions)]
    storage = proposer.kv_cache.storage  # [L, 2, N, bs, H, D]
    flat = storage.reshape(storage.shape[0], 2, -1, *storage.shape[-2:])
    return flat[:, :, slots].clone()


def drafter_caches(method: str, graphs: bool = False, defer: bool = True) -> list[torch.Tensor]:
    """The drafter's cache of one request's verified positions after 16 tokens: the loaded k every step, then
    with stretches of k = 0. `graphs`: the drafter's passes captured (the CPU's eager replays), their counts
    checked: without deferral (`defer`), steps without drafting replay the one-row context graph (with it they run
    no pass: test_deferred_context.py)."""
    caches = []
    for cycle in ([3], [0, 0, 0, 3, 0, 3, 3, 0]):
        session = spec_session(method, 3, max_num_batched_tokens=128)
        assert session.proposer is not None
        if not defer:
            session.engine.deferred = None
        if graphs:
            session.proposer.capture_graphs(4, 8)
        session.engine.speculation = Scripted(cycle, [0, 3])
        request = session.new_request("r", list(range(5, 25)), greedy(), 24, Collector())
        session.engine.add(request)
        session.engine._drain_commands()
        for _ in range(40):
            if len(request.output_ids) >= 16:
                break
            session.engine.step()
        verified = request.num_computed_tokens - 1
        caches.append(drafter_cache(session, request, verified))
        context = f"{method.removesuffix('3')}_context row"
        if graphs and not defer and 0 in cycle:  # every k = 0 step's context pass replayed the one-row graph
            counts = session.proposer.pass_counts
            assert counts[f"{context} graph"] >= cycle.count(0) and counts[f"{context} eager"] == 0, counts
        session.engine.abort(["r"])
        session.engine.run_until_idle()
    return caches


@pytest.mark.parametrize(
    ("method", "graphs", "defer"),
    [(m, g, d) for m in ("eagle3", "dflash") for g, d in ((False, True), (True, True), (True, False))],
)
def test_the_drafter_cache_follows_steps_without_drafting(method: str, graphs: bool, defer: bool) -> None:
    """Every verified position's drafter K/V after stretches of k = 0 equals the K/V of the loaded k throughout
    (drafting resumes from a complete cache): the held context runs with the next proposal, or without deferral
    the context pass runs on those steps, eagerly or from the one-row context graph."""
    fixed, switching = drafter_caches(method, graphs, defer)
    assert fixed.abs().sum() > 0
    torch.testing.assert_close(switching, fixed, rtol=1e-4, atol=1e-5)


def test_the_cache_check_sees_a_skipped_context_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a drafter that skips steps without drafting leaves holes the check above finds (with
    deferral such a step is only the prompts' prefill, a chunk past DEFER_MAX: see test_deferred_context.py for
    held rows lost)."""
    propose = Proposer.propose

    def skipping(self: Proposer, batch: ProposeBatch) -> None:
        if any(e.propose for e in batch.entries):
            propose(self, batch)

    monkeypatch.setattr(Proposer, "propose", skipping)
    fixed, switching = drafter_caches("eagle3")
    assert not torch.allclose(switching, fixed, rtol=1e-4, atol=1e-5)


def test_measured_choice_keeps_tokens_and_reports_k() -> None:
    """The real model on CPU step times: whatever it picks, the tokens are target-only's; the metrics count a
    step per planned k."""
    session = spec_session("eagle3", 3, max_num_batched_tokens=128, adaptive=True)
    speculation = session.engine.speculation
    assert speculation is not None and speculation.candidates == [0, 1, 2, 3]  # no graphs on the CPU: every k
    metrics = EngineMetrics(CollectorRegistry())
    speculation.observer = metrics.on_plan
    batch = prompts(6, seed=9)
    sink = generate(session, batch, 24)
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 24), rid
    assert speculation.chosen and sum(speculation.chosen.values()) > 0
    for k, steps in speculation.chosen.items():
        assert metrics.speculative_k_steps.labels(str(k))._value.get() == steps
    assert metrics.speculative_k._value.get() == speculation.last_planned
    assert speculation.describe()["step_ms"]  # steady steps were timed
    assert_no_leak(session)


def test_fixed_speculation_setting() -> None:
    session = spec_session("eagle", 3)
    assert session.engine.speculation is None  # adaptive off: the loaded k every step


def test_only_decode_and_verify_steps_price_a_k() -> None:
    """A step that prefills (a prompt's last chunk, its request verifying nothing) is not a k = 0 step: its time is
    the prompts'. Every step the cost model records scheduled exactly k + 1 tokens per request."""
    session = spec_session("eagle3", 3, max_num_batched_tokens=128)
    engine = session.engine
    engine.speculation = speculation = Scripted([0, 3, 0], [0, 3])  # k = 0 planned when the prompts prefill
    scheduled: list = []
    schedule, record, step = engine.scheduler.schedule, speculation.record, engine.step

    def scheduling():  # type: ignore[no-untyped-def]
        found = schedule()
        scheduled.append(found)
        return found

    def stepping() -> None:
        scheduled.clear()
        step()

    checked: list[int] = []

    def recording(batch: int, k: int, seconds: float) -> None:
        if scheduled:  # a step scheduled on the host (device steps launched ahead schedule nothing)
            assert scheduled[-1].num_new_tokens == [k + 1] * batch, (scheduled[-1].num_new_tokens, k)
            checked.append(k)
        record(batch, k, seconds)

    engine.scheduler.schedule, speculation.record, engine.step = scheduling, recording, stepping  # type: ignore[method-assign]
    sink = Collector()
    add_all(session, prompts(6, seed=11), greedy(16), sink)
    engine.run_until_idle()
    assert checked  # steady steps were recorded, each checked
    assert_no_leak(session)

"""Releasing requests from a drafter whose measured acceptance rules drafting out (drafter_release.py), fp32 on the
CPU: released requests run no drafter pass, stage no rows and take the overlapped target-only decode step; requests
admitted meanwhile skip the drafter's prompt pass; after the retry interval new requests are followed and drafted
for again, and released again while the drafter stays hopeless. Greedy tokens equal target-only's throughout.
Negative controls: with the release off the same drafter keeps staging and flushing; a right drafter is never
released and every step keeps the cost model's choice. Abort and preemption of released requests clean up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from engine_driving import Collector, run_bounded
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import Priced, ReplayDrafts, Scripted, rule_out, spec_session
from spec_checks import assert_no_leak, prompts
from tree_cases import tree_session

from executor_service.engine.request import Request
from executor_service.engine.scheduler import ScheduledStep
from executor_service.server.session import ModelSession
from executor_service.spec_decode.adaptive_k import AdaptiveK
from executor_service.spec_decode.drafter_release import MIN_VERIFIED, MIN_VERIFIED_COST
from executor_service.spec_decode.proposer import ProposeBatch
from specdec.v1 import common_pb2

K = 3
MAX_TOKENS = 40
RELEASED_TOKENS = 96  # the release on cost: judged, k = 0 chosen, its loss confirmed by checks, then released


class Drafting:
    """A session whose drafter replays the target's own tokens (`wrong`: the first draft corrupted, so nothing is
    ever accepted; None: the drafter's own drafts), with the requests it serves, their reference tokens and the
    drafter's proposals by request."""

    def __init__(self, session: ModelSession, wrong: bool | None = True) -> None:
        self.session, self.engine, self.sink = session, session.engine, Collector()
        self.requests: dict[str, Request] = {}
        self.references: dict[str, list[int]] = {}
        self.proposed: Counter[str] = Counter()  # host-path proposals (context passes and drafts) per request
        proposer = session.proposer
        assert proposer is not None and self.engine.release is not None
        self.proposer, self.release = proposer, self.engine.release
        self.warm_up_passes = Counter(proposer.pass_counts)  # the session's warm-up ran the drafter
        if wrong is not None:
            proposer.replay = ReplayDrafts(self.references, proposer.config.model.vocab_size, 0 if wrong else None)
        propose = proposer.propose

        def recording(batch: ProposeBatch) -> None:
            self.proposed.update(e.request.request_id for e in batch.entries)
            propose(batch)

        proposer.propose = recording  # type: ignore[method-assign]

    def add(self, batch: dict[str, list[int]], max_tokens: int = MAX_TOKENS) -> list[Request]:
        model = self.session.loaded.model
        added = []
        for rid, prompt in batch.items():
            self.references[rid] = greedy_reference(model, prompt, max_tokens + K + 1)
            request = self.session.new_request(rid, prompt, greedy(max_tokens), max_tokens, self.sink)
            self.requests[rid] = request
            self.engine.add(request)
            added.append(request)
        self.engine._drain_commands()
        return added

    def step_until(self, done: Callable[[], bool], max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.engine.step()
            self.engine._drain_commands()
        raise AssertionError("not reached")

    def check_tokens(self) -> None:
        for rid, request in self.requests.items():
            assert self.sink.tokens(rid) == self.references[rid][: request.max_tokens], rid


def scripted(
    cycle: list[int], method: str = "eagle3", releases: bool = True, wrong: bool | None = True, **sizes: int
) -> Drafting:
    session = spec_session(method, K, max_num_batched_tokens=256, **sizes)
    session.engine.speculation = Scripted(cycle, [0, K], releases=releases)
    return Drafting(session, wrong)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("release", [True, False], ids=["released", "negative-control"])
def test_an_always_wrong_drafter_stops_following(method: str, release: bool) -> None:
    """Drafting for 6 steps (nothing accepted), then k = 0: once the acceptance rules drafting out, every request
    is released and the rest of the run is target-only work: no drafter pass, no staged row, no lookahead, every
    step the overlapped decode. With the release off, the drafter keeps following (rows held, flushes)."""
    drafting = scripted([K] * 6 + [0] * 100, method, releases=release)
    engine, deferred = drafting.engine, drafting.engine.deferred
    assert deferred is not None
    batch = prompts(8, seed=4)
    drafting.add(batch)
    speculation = engine.speculation
    assert speculation is not None
    drafting.step_until(lambda: AdaptiveK.drafting_ruled_out(speculation, MIN_VERIFIED) and engine._planned == 0)
    if release:
        assert drafting.release.counts["released"] == len(batch)
        assert all(r.num_draft_tokens == 0 and engine.scheduler.lookahead(r) == 0 for r in drafting.requests.values())
        ruling = drafting.release.describe()
        assert ruling["ruled out by acceptance"] == 1 and "ruled out by cost" not in ruling, ruling
        assert [r["rule"] for r in ruling["rulings"]] == ["acceptance"]  # type: ignore[union-attr]
        assert ruling["rulings"][0]["expected_tokens"][K] < 1.1  # type: ignore[index]  # what it stood on
        assert not deferred.held and deferred.filled == 0
    passes, held, steps = Counter(drafting.proposer.pass_counts), Counter(deferred.counts), Counter(engine.step_counts)
    proposed = Counter(drafting.proposed)
    run_bounded(engine)
    drafting.check_tokens()
    assert_no_leak(drafting.session)
    if not release:  # the negative control: k = 0 steps kept the drafter following
        assert deferred.counts["deferred steps"] > held["deferred steps"] and drafting.proposed != proposed
        return
    assert drafting.proposer.pass_counts == passes and drafting.proposed == proposed  # no drafter pass after
    assert deferred.counts == held and not deferred.held and deferred.filled == 0  # nothing staged or flushed
    assert engine.step_counts["overlapped decode"] > steps["overlapped decode"] + 20
    assert engine.step_counts["host"] == steps["host"] and engine.step_counts["device"] == steps["device"]


def test_a_right_drafter_is_never_released() -> None:
    """The negative control with the real cost model: a drafter whose drafts are all accepted keeps drafting, and
    every step is planned by the cost model."""
    session = spec_session("eagle3", K, max_num_batched_tokens=256, adaptive=True)
    drafting = Drafting(session, wrong=False)
    speculation = session.engine.speculation
    assert speculation is not None
    plans = [0]
    plan = speculation.plan

    def counting(request_ids: Sequence[str], undrafted: int = 0) -> int:
        plans[0] += 1
        return plan(request_ids, undrafted)

    speculation.plan = counting  # type: ignore[method-assign]
    drafting.add(prompts(8, seed=6))
    run_bounded(session.engine)
    drafting.check_tokens()
    assert drafting.release.counts["released"] == 0 and not speculation.drafting_ruled_out(MIN_VERIFIED)
    assert sum(speculation.chosen.values()) == plans[0] > 0  # no step planned without the cost model
    finishes = [outputs[-1].finish for outputs in drafting.sink.outputs.values()]
    assert all(f is not None and f.drafted_tokens > 0 and f.accepted_tokens == f.drafted_tokens for f in finishes)
    assert_no_leak(session)


def test_requests_admitted_while_ruled_out_skip_the_drafter_until_the_retry() -> None:
    """Ruled out: new requests are released before the drafter's pass over their prompts. After the retry interval
    the acceptance starts afresh: newer requests are followed and drafted for beside the released ones (the device
    step for them, the host path beside it), measure the acceptance again, and are released again."""
    drafting = scripted([K])
    engine, release = drafting.engine, drafting.release
    release.retry_steps = 10**6
    rule_out(engine.speculation)
    first = drafting.add(prompts(4, seed=1))
    drafting.step_until(lambda: all(len(r.output_ids) >= 3 for r in first))
    assert release.counts["released"] == len(first) and not drafting.proposed  # no prompt pass for them
    assert drafting.proposer.pass_counts == drafting.warm_up_passes
    release.retry_steps = release.steps_ruled_out + 1
    engine.step()
    assert release.counts["retries"] == 1 and not AdaptiveK.drafting_ruled_out(engine.speculation, MIN_VERIFIED)
    later = drafting.add({f"later{i}": p for i, p in enumerate(prompts(4, seed=2).values())})
    drafting.step_until(lambda: release.counts["released"] == len(first) + len(later), max_steps=60)
    assert all(drafting.proposed[r.request_id] > 0 for r in later)
    assert not any(drafting.proposed[r.request_id] for r in first)
    assert all(r.verify_steps > 0 and r.accepted_tokens == 0 for r in later)
    assert all(r.verify_steps == 0 for r in first)
    assert engine.step_counts["device beside host"] > 0  # followed and released requests in one step
    run_bounded(engine)
    drafting.check_tokens()
    assert_no_leak(drafting.session)


def test_a_mostly_released_batch_keeps_the_overlapped_step() -> None:
    """Five released requests and one followed at k = 0: the steps are overlapped (the followed request's row staged
    in the log), the drafter runs for the followed request alone, and its drafts when drafting resumes are those of
    a batch where every request is followed."""
    cycle = [0] * 14 + [K] * 3
    batch = {f"r{i}": [(7 * i + j) % 500 + 1 for j in range(10 + i)] for i in range(6)}
    drafts = []
    for released in (True, False):
        drafting = scripted(cycle, releases=False, wrong=None)
        seen: dict[tuple[int, int], list[int]] = {}

        def record(request: Request, ids: list[int], seen: dict = seen) -> list[int]:
            if request.request_id == "r0":  # the drafter's own drafts: they read its cache
                seen[request.num_tokens, request.num_computed_tokens] = list(ids)
            return ids

        drafting.proposer.replay = record
        added = drafting.add(batch)
        if released:
            for request in added[1:]:
                drafting.release.release(request)
        run_bounded(drafting.engine)
        drafting.check_tokens()
        assert_no_leak(drafting.session)
        if released:
            assert set(drafting.proposed) == {"r0"}
            assert drafting.engine.step_counts["overlapped decode"] > 10
        drafts.append(seen)
    mixed, followed = drafts
    assert len(mixed) >= 6 and mixed == {state: followed[state] for state in mixed}


def test_released_requests_abort_and_preempt_cleanly() -> None:
    """A cache too small for the batch: released requests are preempted, computed again from their tokens and stay
    released (no drafter pass, no lookahead); one is aborted midway. Nothing leaks, tokens are target-only's."""
    drafting = scripted([K], num_kv_blocks=10)
    engine = drafting.engine
    rule_out(engine.speculation)
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def scheduling() -> ScheduledStep:
        step = schedule()
        preempted.extend(r.request_id for r in step.preempted)
        return step

    engine.scheduler.schedule = scheduling  # type: ignore[method-assign]
    batch = {f"r{i}": [(7 * i + j) % 500 + 1 for j in range(12 + 2 * i)] for i in range(4)}
    batch["gone"] = list(range(3, 20))
    drafting.add(batch)
    drafting.step_until(lambda: len(drafting.sink.tokens("gone")) >= 3)
    assert engine.abort(["gone"]) == ["gone"]
    drafting.requests.pop("gone")
    run_bounded(engine)
    assert drafting.sink.outputs["gone"][-1].finish.reason == "abort"  # type: ignore[union-attr]
    drafting.check_tokens()
    assert preempted and not drafting.proposed and drafting.proposer.pass_counts == drafting.warm_up_passes
    assert drafting.release.counts["released"] >= len(batch)
    assert engine.deferred is not None and not engine.deferred.held
    assert_no_leak(drafting.session)


def test_trees_are_released_midway() -> None:
    """Trees drafted for a few steps, then the acceptance rules drafting out: the drafts in hand are verified, no
    tree is drafted after, tokens are target-only's."""
    session = tree_session("eagle3", common_pb2.DraftTree(top_k=2, verify_budget=6), k=3, max_num_batched_tokens=256)
    assert session.proposer is not None
    size = session.proposer.num_draft_tokens
    session.engine.speculation = Scripted([size], [0, size], releases=True)
    engine, sink = session.engine, Collector()
    batch = prompts(4, seed=8, vocab=256)
    for rid, prompt in batch.items():
        engine.add(session.new_request(rid, prompt, greedy(24), 24, sink))
    engine._drain_commands()
    for _ in range(4):
        engine.step()
    assert session.proposer.pass_counts
    rule_out(engine.speculation)
    engine.step()
    engine.step()
    passes = Counter(session.proposer.pass_counts)
    run_bounded(engine)
    assert engine.release is not None and engine.release.counts["released"] == len(batch)
    assert session.proposer.pass_counts == passes
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 24), rid
    assert_no_leak(session)


@pytest.mark.parametrize(
    ("prices", "released"),
    [({0: 0.010, K: 0.025}, True), ({0: 0.010, K: 0.015}, False)],
    ids=["drafting-loses", "negative-control"],
)
def test_a_drafter_that_loses_on_cost_is_released(prices: dict[int, float], released: bool) -> None:
    """A drafter whose first draft is right and the rest wrong (two tokens a step: its acceptance rules nothing
    out), a speculative step priced at 2.5 decode steps: once MIN_VERIFIED_COST request-steps measure that, drafting
    loses to k = 0 at the batch's size (80 against 100 tokens a second a request), and once CONFIRMING_CHECKS checks
    confirm it, every request is released, the rest of the run target-only work. Negative control: priced at 1.5
    decode steps, drafting pays (133) and nobody is released."""
    session = spec_session("eagle3", K, max_num_batched_tokens=256)
    speculation = session.engine.speculation = Priced(prices)
    drafting = Drafting(session, wrong=None)
    drafting.proposer.replay = ReplayDrafts(drafting.references, drafting.proposer.config.model.vocab_size, 1)
    engine, deferred = drafting.engine, drafting.engine.deferred
    assert deferred is not None
    batch = prompts(8, seed=7)
    drafting.add(batch, max_tokens=RELEASED_TOKENS)  # room for the checks that confirm the loss
    if released:
        drafting.step_until(lambda: drafting.release.counts["released"] == len(batch))
        assert not speculation.drafting_ruled_out(MIN_VERIFIED) and speculation.drafting_loses(8, MIN_VERIFIED_COST)
        assert all(r.num_draft_tokens == 0 and engine.scheduler.lookahead(r) == 0 for r in drafting.requests.values())
        passes, steps = Counter(drafting.proposer.pass_counts), Counter(engine.step_counts)
        (ruling,) = drafting.release.rulings  # the evidence of the one ruling: two tokens a step, k's step dearer
        assert ruling["rule"] == "cost" and ruling["batch"] == 8 and ruling["traffic_requests"] == 8, ruling
        assert ruling["expected_tokens"] == {0: 1.0, K: pytest.approx(2.0, abs=0.1)}, ruling
        assert ruling["step_ms"] == {0: pytest.approx(10.0), K: pytest.approx(25.0)}, ruling
    run_bounded(engine)
    drafting.check_tokens()
    assert_no_leak(drafting.session)
    finishes = [outputs[-1].finish for outputs in drafting.sink.outputs.values()]
    assert all(f is not None and f.accepted_tokens > 0 for f in finishes)  # drafted, half right, before any release
    if not released:
        assert drafting.release.counts["released"] == 0 and not speculation.drafting_loses(8, MIN_VERIFIED_COST)
        assert drafting.release.describe() == {"rulings": []}
        assert all(f is not None and f.verify_steps * 2 >= RELEASED_TOKENS - 2 for f in finishes)  # drafted throughout
        return
    assert drafting.proposer.pass_counts == passes and not deferred.held  # no drafter pass after the release
    assert engine.step_counts["overlapped decode"] > steps["overlapped decode"] + 10


def test_retries_that_fail_back_off() -> None:
    """A retry whose requests are ruled out again within the retry interval doubles the interval before the next
    (up to MAX_RETRY_BACKOFF times): a drafter that never pays costs fewer and fewer retries. One after which
    drafting went on for a whole interval resets it."""
    from types import SimpleNamespace

    from executor_service.spec_decode.drafter_release import MAX_RETRY_BACKOFF, DrafterRelease

    interval = 10
    release = DrafterRelease(None, retry_steps=interval)
    speculation = AdaptiveK((0, K), configured=K)
    released = [SimpleNamespace(num_draft_tokens=0)]  # a batch the drafter no longer follows

    def steps_to_retry() -> int:
        """Rule drafting out and count the steps until the next retry."""
        rule_out(speculation)
        retries = release.counts["retries"]
        for steps in range(1, 100 * interval):
            release.followed(released, speculation)  # type: ignore[arg-type]
            if release.counts["retries"] > retries:
                return steps
        raise AssertionError("no retry")

    waits = []
    for _ in range(5):
        waits.append(steps_to_retry())
        for _ in range(3):  # the retried requests draft a few steps, then are ruled out again
            assert release.followed(released, speculation) is False  # type: ignore[arg-type]
    assert waits == [interval * min(2**i, MAX_RETRY_BACKOFF) for i in range(5)]
    for _ in range(interval):  # this retry's drafting pays for a whole interval
        release.followed(released, speculation)  # type: ignore[arg-type]
    assert steps_to_retry() == interval and release.describe()["retry_backoff"] == 1

"""The engine's step: schedule, run the target, verify, book, emit, propose (on the thread of engine_loop.py).

The engine thread owns the scheduler and the cache; each step hands each request's new tokens to the
request's sink.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from executor_service.engine.engine_loop import EngineLoop
from executor_service.engine.host_step import draft_inputs, path_moves, verify_drafts
from executor_service.engine.one_time_work import compiles, watch_triton_compiles
from executor_service.engine.outcome import StepOutcome
from executor_service.engine.overlap_decode import DecodeOverlap, LaunchedDecode
from executor_service.engine.request import Finish, Request, RequestOutput, Sink, Status
from executor_service.engine.scheduler import ScheduledStep, Scheduler
from executor_service.engine.slow_steps import SlowSteps
from executor_service.engine.step_parts import split_for_device
from executor_service.models.attention_step import to_device
from executor_service.runner.model_runner import ModelRunner, StepInputs
from executor_service.sample.logprobs import TokenLogprob
from executor_service.spec_decode.adaptive_k import AdaptiveK
from executor_service.spec_decode.deferred_context import DeferredContext
from executor_service.spec_decode.drafter_release import DrafterRelease, follows_any
from executor_service.spec_decode.host_verify import DraftTree, TreeVerdict, VerifyError, check_drafts
from executor_service.spec_decode.proposer import ProposeBatch, ProposeEntry, Proposer
from executor_service.spec_decode.spec_step import PendingStep, SpecStep, VerifiedStep

log = logging.getLogger("specdec.engine")

StepObserver = Callable[[int, int, float], None]  # (tokens computed, tokens generated, seconds)
VerifyObserver = Callable[[list[int], list[int]], None]  # per verified request: (drafts, accepted drafts)


class Engine(EngineLoop):
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        max_model_len: int,
        on_step: StepObserver | None = None,
        proposer: Proposer | None = None,
        on_verify: VerifyObserver | None = None,
        spec_step: SpecStep | None = None,
        speculation: AdaptiveK | None = None,
        defer_context: bool = True,
        overlap_decode: bool = True,
        release_drafter: bool = True,
    ) -> None:
        super().__init__(scheduler)
        self.runner, self.max_model_len = runner, max_model_len
        self.on_step, self.proposer, self.on_verify = on_step, proposer, on_verify
        self.spec_step = spec_step  # verify + accept + propose on the device, for steps of whole drafts
        self._outbox: list[tuple[Sink, RequestOutput]] = []  # in order; see _flush_outbox
        self._in_flight: tuple[list[Request], PendingStep] | None = None  # see _book_on_device
        # The drafts each step verifies, chosen from measured costs (adaptive_k.py); None: always the loaded k.
        self.speculation = speculation
        self._steady: tuple[int, int] | None = None  # this step's (batch, k) when it ran steadily at one k
        self._planned: int | None = None  # this step's plan (`_plan`), once made
        # Steps without drafting hold the drafter's context for a later batched pass (deferred_context.py); None:
        # the drafter's context pass runs every step.
        self.deferred = DeferredContext(scheduler.max_num_seqs) if proposer is not None and defer_context else None
        self._flushed: tuple[bool, int] | None = None  # this step's flush: (at k = 0, the k = 0 steps it served)
        self._last_flush: tuple[int, float | None] | None = None  # see _price
        # With adaptive speculation, requests are released from a drafter whose acceptance rules drafting out
        # (drafter_release.py); None: the drafter follows every request for its life.
        self.release = DrafterRelease(self.deferred) if proposer is not None and release_drafter else None
        # Steps by path ("host", "device") and the drafts the host path verified ("host drafts"): tests assert a
        # batch stays on the device step; benchmarks report it.
        self.step_counts: Counter[str] = Counter()
        # Steady decode steps launch the step after them before their read-back (overlap_decode.py): without a
        # drafter, and with one at adaptive speculation's k = 0 while its context is held (each step's feature rows
        # staged in the log before the next step is launched); `overlap_decode` False: every step serially (a
        # benchmark may switch it between runs).
        overlapping = proposer is None or self.deferred is not None
        self.overlap = DecodeOverlap(runner, scheduler, max_model_len) if overlapping else None
        self.overlap_decode = overlap_decode
        self._decoding: LaunchedDecode | None = None  # an overlapped decode step launched, not yet booked
        self.slow = SlowSteps.from_env(self._counters())  # SPECDEC_SLOW_STEP_MS: slow steps logged (slow_steps.py)
        if speculation is not None:
            watch_triton_compiles()

    def _steps_pending(self) -> bool:
        return self._in_flight is not None or self._decoding is not None

    def step(self) -> None:
        """One step (`_step`); a step that ran steadily at one k gives the speculation its wall time."""
        started = time.perf_counter()
        self._steady, self._planned, self._flushed = None, None, None
        if self.slow is not None:
            self.slow.start()
        once_before = self._one_time_work() if self.speculation is not None else 0
        self._step(started)
        if self.speculation is not None:
            self._price(time.perf_counter() - started, once_before)
        if self.slow is not None:
            self.slow.finish(time.perf_counter() - started, len(self.scheduler.running), self._planned)

    def _one_time_work(self) -> int:
        """Kernels compiled and sampler graphs captured so far (one_time_work.py): a step that does either is
        hundreds of milliseconds of work no later step of its kind repeats, so it prices nothing."""
        captured = self.overlap.captured() if self.overlap is not None else 0
        return compiles() + captured

    def _counters(self) -> dict[str, Callable[[], Counter[str]]]:
        """What a slow step's log line reports the moves of (slow_steps.py), read when it is logged (tests and
        benchmarks swap the device step out)."""
        return {
            "engine": lambda: self.step_counts,
            "spec_step": lambda: self.spec_step.counts if self.spec_step is not None else Counter(),
            "deferred": lambda: self.deferred.counts if self.deferred is not None else Counter(),
            "sampler": lambda: self.overlap.captures() if self.overlap is not None else Counter(),
        }

    def _step(self, started: float) -> None:
        """One step, in the order a reader follows: schedule, run the target once, verify, accept (roll back
        rejected drafts' K/V), emit the tokens, propose the next drafts. When every request verifies a whole
        draft of the loaded shape, the device step (spec_step.py) does all of it as one pass instead."""
        if self._in_flight is not None:  # a device step launched behind the last one: book it
            requests, pending = self._in_flight
            self._in_flight = None
            self._book_on_device(requests, pending, started)
            return
        if self._decoding is not None:  # a decode step launched behind the last one: book it
            decoding, self._decoding = self._decoding, None
            self._decode_overlapped(decoding, started)
            return
        self._fail_alone(self._bad_drafts())
        scheduled = self.scheduler.schedule()
        self._fail_alone(scheduled.failed)  # requests that can never fit the cache
        if self.deferred is not None:  # computed again from their tokens: their held context is another life's
            for request in scheduled.preempted:
                self.deferred.drop(request)
        if not scheduled:
            return
        spec_step = self.spec_step
        parts = split_for_device(scheduled, spec_step.rows, spec_step.takes) if spec_step is not None else None
        if parts is not None and self._device_beside(scheduled, *parts, started):
            return
        try:
            inputs = self.runner.prepare(scheduled)
            pending = self._launch_on_device(inputs, scheduled.requests)
            decoding = self._launch_decode(scheduled, inputs) if pending is None else None
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(scheduled.requests, err)
            return
        if pending is not None:
            self._book_on_device(scheduled.requests, pending, started)
            return
        if decoding is not None:
            self._decode_overlapped(decoding, started)
            return
        self._host_step(scheduled, inputs, started)

    def _launch_decode(self, scheduled: ScheduledStep, inputs: StepInputs) -> LaunchedDecode | None:
        """A steady decode step, launched with its sampling on the device (overlap_decode.py): target-only, or
        with a drafter when adaptive speculation planned k = 0 for it; None: the host path runs the step."""
        if self.overlap is None or not self._chains() or not self.overlap.applies(scheduled):
            return None
        if self.proposer is not None and (self.speculation is None or self.speculation.last_planned != 0):
            return None
        return self.overlap.launch(inputs, scheduled.requests)

    def _decode_overlapped(self, step: LaunchedDecode, started: float) -> None:
        """Book a decode step sampled on the device. When its batch goes on unchanged, the step after it is
        launched first, so the device runs that one while the host reads this one back and books it; the next
        engine step books that one. With a drafter the next step's k is planned first: only k = 0 goes on, the
        step's feature rows staged in the held context's log before the next step overwrites them; a step of
        requests all released from the drafter (drafter_release.py) is booked as a target-only one."""
        assert self.overlap is not None
        try:
            k_next = self._plan(step.requests) if self.proposer is not None else None
            follows = self.proposer is not None and follows_any(step.requests)  # after the plan's release
            following = (
                self.overlap.launch_following(step) if self._chains() and self._stages(step, k_next, follows) else None
            )
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            outcomes, failed = self.overlap.outcomes(step)
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(step.requests, err)
            return
        self.step_counts["overlapped decode" if step.ahead else "decode on device"] += 1
        self._fail_alone(failed)
        generated, _ = self._book(outcomes)
        self.overlap.booked([o.request for o in outcomes])  # after their emit: the step counted what it appended
        if follows:  # its rows held (staged) or, where nothing was launched after it, proposed
            self._propose(outcomes, step.features, k_next, staged=step.staged)
            self._cache_prefixes(step.requests)
        if self.proposer is not None:
            self._note_steady(len(outcomes), {0}, k_next)
        if following is not None and following.live():  # else every request of it finished: nothing to book
            self._decoding = following
        if self.on_step is not None:
            self.on_step(len(step.requests), generated, time.perf_counter() - started)

    def _stages(self, step: LaunchedDecode, k_next: int | None, follows: bool) -> bool:
        """Whether a step may be launched after `step`: always where the drafter `follows` none of its requests;
        else at k = 0 once `step`'s feature rows are staged in the held context's log (deferred_context.py: not
        where a request's rows would pass the limit or the log is full; that step is booked as the host path's,
        flushing from its features)."""
        if not follows:
            return True
        if k_next != 0 or self.deferred is None or step.features is None:
            return False
        step.staged = self.deferred.stage(step.requests, step.features)
        return step.staged is not None

    def _chains(self) -> bool:
        """Whether a decode step may launch the one after it: overlap on, and no command waiting to change the
        batch (an arrival, an abort) first."""
        return self.overlap_decode and self._commands.empty()

    def _device_beside(
        self, scheduled: ScheduledStep, device_part: ScheduledStep, beside: ScheduledStep, started: float
    ) -> bool:
        """A step whose running requests verify whole drafts while others prefill or draft fewer (step_parts.py):
        the first on the device step, the others on the host path beside it, one plan of the next k for all.
        False: the device step refused its part (the whole step then takes the host path)."""
        try:
            pending = self._launch_on_device(self.runner.prepare(device_part), device_part.requests)
        except Exception as err:  # a kernel or device failure fails that part's requests; the others go on
            self._fail(device_part.requests, err)
            pending = None
            device_part = ScheduledStep()
        if pending is None and device_part:
            return False
        self._plan(scheduled.requests)
        try:
            counts = self._host_step(beside, self.runner.prepare(beside), started, observe=pending is None)
        except Exception as err:
            self._fail(beside.requests, err)
            counts = (0, 0)
        if pending is not None:
            self._book_on_device(device_part.requests, pending, started, beside=counts)
            self.step_counts["device beside host"] += 1
        self._steady = None  # the step's time is both parts': no k's cost
        return True

    def _host_step(
        self, scheduled: ScheduledStep, inputs: StepInputs, started: float, observe: bool = True
    ) -> tuple[int, int]:
        """The host path: the target's pass, verification on the host, booking, the drafter's proposal. Returns
        the tokens computed and generated (`observe`: also tell on_step)."""
        requests = scheduled.requests
        try:
            proposer = self.proposer
            parents = [proposer.tree_of(r) if r.draft_ids else [] for r in requests] if proposer is not None else None
            trees = draft_inputs(scheduled, inputs, parents)
            output = self.runner.execute(inputs)
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            sampled = [requests[i] for i in inputs.sampled]
            verdicts, logprobs = verify_drafts(output.logits, sampled, [trees[i] for i in inputs.sampled])
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(requests, err)
            return 0, 0
        self.step_counts["host"] += 1
        self.step_counts["host drafts"] += sum(len(tree.tokens) for tree in trees if tree is not None)
        self._fail_alone([(r, v) for r, v in zip(sampled, verdicts, strict=True) if isinstance(v, Exception)])
        verified = {i: (v, lp) for i, v, lp in zip(inputs.sampled, verdicts, logprobs, strict=True)}
        outcomes = self._host_outcomes(scheduled, inputs, trees, verified)
        generated, _ = self._book(outcomes)
        if self.proposer is not None:
            k_next = self._plan(requests)
            self._propose(outcomes, output.features, k_next)
            self._cache_prefixes(requests)  # once the drafter wrote its K/V too
            # Steady only if every request verified the same drafts and none prefilled (a prefill step's time is
            # its prompts', not a k's: at batch 128 it priced k = 0 at 200 ms a step).
            drafts = [len(tree.tokens) if tree is not None else 0 for tree in trees]
            if scheduled.num_new_tokens == [n + 1 for n in drafts]:
                self._note_steady(len(sampled), set(drafts), k_next)
        if observe and self.on_step is not None:
            self.on_step(scheduled.num_tokens, generated, time.perf_counter() - started)
        return scheduled.num_tokens, generated

    def _host_outcomes(
        self,
        scheduled: ScheduledStep,
        inputs: StepInputs,
        trees: list[DraftTree | None],
        verified: dict[int, tuple[TreeVerdict | VerifyError, list[TokenLogprob] | None]],
    ) -> list[StepOutcome]:
        """Each running request's outcome of a host step (`verified`: the sampled ones' verdicts and logprobs,
        by batch index); a tree's accepted path K/V is moved into place here, every layer at once."""
        block_size = self.runner.kv_cache.block_size
        sources, targets, outcomes = [], [], []
        for index, (request, row_start, num_new) in enumerate(
            zip(scheduled.requests, inputs.row_starts, scheduled.num_new_tokens, strict=True)
        ):
            if request.status is not Status.RUNNING:  # its verification failed: finished above
                request.draft_ids, request.draft_probs = [], None
                continue
            verdict, logprobs = verified.get(index, (None, None))
            emitted = verdict.emitted if isinstance(verdict, TreeVerdict) else []
            tree = trees[index]
            if tree is None:
                rows = list(range(row_start, row_start + num_new))
                outcome = StepOutcome(request, request.num_computed_tokens + num_new, emitted, logprobs=logprobs)
            else:
                assert isinstance(verdict, TreeVerdict)
                path = verdict.path
                root_row = row_start + num_new - 1 - len(tree.tokens)
                root = request.num_computed_tokens + root_row - row_start  # the root's position (and slot index)
                moves = path_moves(request, root, path, block_size)
                sources += moves[0]
                targets += moves[1]
                rows = [*range(row_start, root_row + 1), *(root_row + 1 + node for node in path)]
                depth = max(tree.depths())
                outcome = StepOutcome(
                    request, root + 1 + len(path), emitted, len(tree.tokens), len(path), depth, logprobs
                )
            outcome.row_start, outcome.num_rows, outcome.verified_rows = row_start, num_new, rows
            outcomes.append(outcome)
        if sources:
            device = self.runner.kv_cache.layers[0][0].device
            self.runner.move_kv(to_device(sources, torch.int64, device), to_device(targets, torch.int64, device))
        return outcomes

    def _book(self, outcomes: list[StepOutcome]) -> tuple[int, list[int]]:
        """Book a step's outcomes, the one place for both paths: each request's computed tokens (its accepted
        path kept, the rejected drafts' K/V rolled back by not counting them), its verification's statistics
        (the metrics and the adaptive speculation are told, before a finish makes the speculation forget the
        request), then its emitted tokens up to a stop (a finish frees its blocks: without a drafter the prompt's
        blocks are registered in the prefix cache first). Returns the tokens kept and the drafts each verifying
        request verified."""
        for outcome in outcomes:
            request = outcome.request
            request.num_computed_tokens = outcome.num_computed
            request.draft_ids, request.draft_probs = [], None
            if outcome.num_drafts:
                request.record_verification(outcome.num_drafts, outcome.accepted, positions=outcome.depth)
        if self.proposer is None:  # the K/V is all written: register before a finish frees the blocks
            self._cache_prefixes([o.request for o in outcomes])
        verifying = [o for o in outcomes if o.num_drafts]
        self._observe_verify(verifying)
        generated = 0
        for outcome in outcomes:
            if outcome.emitted:
                generated += self._emit(outcome.request, outcome.emitted, outcome.num_drafts, outcome.logprobs)
        return generated, [o.num_drafts for o in verifying]

    def _launch_on_device(self, inputs: StepInputs, requests: list[Request]) -> PendingStep | None:
        """The step on the device (spec_step.py) when every request verifies a whole draft of the loaded shape
        and has room for what the step may write; None: the host path runs it."""
        spec_step = self.spec_step
        if spec_step is None or not spec_step.accepts(inputs, requests):
            return None
        if self.deferred is not None and self.deferred.holds_any(requests):  # the host path flushes it first
            return None
        if any(spec_step.reach(r) > self.max_model_len for r in requests):
            return None
        if not all(self.scheduler.reserve(r, spec_step.reach(r)) for r in requests):
            return None
        return spec_step.launch(inputs, requests)

    def _book_on_device(
        self, requests: list[Request], pending: PendingStep, started: float, beside: tuple[int, int] = (0, 0)
    ) -> None:
        """Book a device step: its accepted path's K/V is in place; count the kept rows, emit the tokens and hand
        each running request its next drafts. When the same batch can go on, the step after it is launched
        first, its inputs derived on the device, so the device runs it while the host reads this one back and
        books it: one read-back per step, overlapped with the next step."""
        assert self.spec_step is not None and self.proposer is not None
        k_next = self._plan(requests)
        try:
            following = (
                self._launch_following(requests, pending) if k_next in (None, self.spec_step.num_draft_tokens) else None
            )
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            result = pending.result()
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(requests, err)
            return
        self.step_counts["device"] += 1
        running = [(i, r) for i, r in enumerate(requests) if r.status is Status.RUNNING]  # some finished meanwhile
        outcomes = [self._device_outcome(result, index, request) for index, request in running]
        generated, drafted = self._book(outcomes)
        for index, request in running:
            self.spec_step.table.booked(request)  # after its emit: the step counted what it appended
            if request.status is Status.RUNNING:
                tokens, parents = self.spec_step.next_tree(result, index)
                probs = result.draft_probs(index, request.settings.greedy)
                self.proposer.set_tree(request, tokens, parents, probs)
                cap_drafts(request, k_next)
        self._cache_prefixes(requests)  # once the drafter wrote its K/V too
        if following is not None:
            self._in_flight = following
        self._note_steady(len(drafted), set(drafted), k_next)
        if self.on_step is not None:  # `beside`: the host path's part of the same step (computed, generated)
            computed = len(requests) * self.spec_step.rows + beside[0]
            self.on_step(computed, generated + beside[1], time.perf_counter() - started)

    def _device_outcome(self, result: VerifiedStep, index: int, request: Request) -> StepOutcome:
        """Request `index`'s outcome of a device step."""
        assert self.spec_step is not None
        kept = request.num_computed_tokens + result.kept_rows(index)  # roll back: rejected drafts' K/V not kept
        logprobs = result.token_logprobs(index, request.settings.logprobs)
        depth = self.spec_step.depth_of(request)
        return StepOutcome(
            request, kept, result.emitted(index), len(request.draft_ids), result.accepted[index], depth, logprobs
        )

    # ---- adaptive speculation (adaptive_k.py) ---------------------------------------------------
    def _plan(self, requests: list[Request]) -> int | None:
        """The drafts per request of the next step for these requests' batch (planned for its running requests'
        own acceptance); None: the loaded k, always. Where the measured acceptance rules drafting out, the
        requests are released from the drafter first, and a batch the drafter follows none of is planned at k = 0
        without a choice (drafter_release.py)."""
        speculation = self.speculation
        if speculation is None:
            return None
        if self._planned is None:  # once a step: a step run in two parts plans for all its requests
            running = [r for r in requests if r.status is Status.RUNNING]
            if self.release is None or not running or self.release.followed(running, speculation):
                drafting = [r.request_id for r in running if r.num_draft_tokens != 0]
                self._planned = speculation.plan(drafting, undrafted=len(running) - len(drafting))
            else:
                self._planned = 0
                speculation.count_plan(0)
        return self._planned

    def _price(self, seconds: float, once_before: int) -> None:
        """Give the speculation this step's wall time (`record`) if it ran steadily at one k. A flush of deferred
        drafter context lands in its own step (the pass's launch) and the next one (on a GPU its device time,
        which the next step's read-back waits for), so neither is a plain sample of its k. A flush at k = 0 (the
        rows reached their limit) is k = 0's own work put off: the two steps' time beyond two plain k = 0 steps
        is spread over the k = 0 steps whose rows it ran (`record_deferred`). A flush where drafting resumes is
        the switch's cost, no k's. `once_before`: `_one_time_work` before the step; a step that compiled a kernel or
        captured a graph is no price."""
        assert self.speculation is not None
        if self._one_time_work() != once_before:
            self._last_flush = None
            return
        steady, flushed = self._steady, self._flushed
        last, self._last_flush = self._last_flush, None
        if flushed is not None:
            at_zero, steps = flushed
            zero = at_zero and steady is not None and steady[1] == 0
            self._last_flush = (steps, seconds if zero else None)
            return
        if last is not None:
            steps, first = last
            if first is not None and steady is not None and steady[1] == 0:
                self.speculation.record_deferred(steady[0], first + seconds, steps, landed=2)
            return
        if steady is not None:
            self.speculation.record(*steady, seconds)

    def _note_steady(self, batch: int, verified: set[int], k_next: int | None) -> None:
        """A step whose every request verified k drafts and drafted k for the next step measures k's cost."""
        if k_next is not None and batch and verified == {k_next}:
            self._steady = (batch, k_next)

    def _observe_verify(self, verifying: list[StepOutcome]) -> None:
        """Per verified request (drafts, accepted, and the depth its drafts reached): the metrics, and the
        speculation by request (its acceptance per request: adaptive_k.py)."""
        if not verifying:
            return
        if self.on_verify is not None:
            self.on_verify([o.num_drafts for o in verifying], [o.accepted for o in verifying])
        if self.speculation is not None:
            reached = [o for o in verifying if o.depth]
            ids, depths = [o.request.request_id for o in reached], [o.depth for o in reached]
            self.speculation.observe_verify(ids, depths, [o.accepted for o in reached])

    def _launch_following(
        self, requests: list[Request], pending: PendingStep
    ) -> tuple[list[Request], PendingStep] | None:
        """The step after `pending` for its requests still running, launched before `pending` is read back, when
        nothing could change the batch in between: no command or waiting request, every running request keeps
        drafting whole drafts of the loaded shape with room for them. Those that finished since `pending` was
        launched (its rows of them are read back but not booked) are left out, so a finish does not break the
        chain: the device goes on while the host books. Scripted drafts (the proposer's replay) need the host."""
        spec_step = self.spec_step
        assert spec_step is not None and self.proposer is not None
        if self.proposer.scripted or self.scheduler.waiting or not self._commands.empty():
            return None
        if self.deferred is not None and self.deferred.held:  # a flush needs the host path
            return None
        kept = [i for i, r in enumerate(requests) if r.status is Status.RUNNING]
        if not kept or len(kept) != len(self.scheduler.running):  # others run beside them: they need the next step
            return None
        going_on = [requests[i] for i in kept]
        for request in going_on:
            if self.proposer.num_drafts(request) != spec_step.num_draft_tokens:
                return None
            if spec_step.reach_following(request) > self.max_model_len:
                return None
        if not all(self.scheduler.reserve(r, spec_step.reach_following(r)) for r in going_on):
            return None
        narrowed = kept if len(kept) < len(requests) else None
        return going_on, spec_step.launch_following(pending, going_on, narrowed)

    def _emit(
        self, request: Request, tokens: list[int], num_drafted: int, logprobs: list[TokenLogprob] | None = None
    ) -> int:
        """Append the verified tokens up to a stop; hand them out. Returns how many were kept. The chunk's
        counts are the verification's (as in the request's totals), also when a stop cuts the tokens short."""
        accepted = len(tokens) - 1
        for count, token in enumerate(tokens, start=1):
            request.output_ids.append(token)
            reason = request.stop_reason(self.max_model_len)
            if reason is not None:
                kept = logprobs[:count] if logprobs is not None else None
                self._finish(
                    request, reason, tokens[:count], num_drafted=num_drafted, num_accepted=accepted, logprobs=kept
                )
                return count
        output = RequestOutput(request.request_id, tokens, num_drafted, accepted, logprobs=logprobs)
        self._outbox.append((request.sink, output))
        return len(tokens)

    def _propose(
        self, outcomes: list[StepOutcome], features: torch.Tensor | None, k_next: int | None, staged: int | None = None
    ) -> None:
        """Draft for the next step from this step's target features (each outcome's verified rows). Requests that
        finished are skipped, and so are those that never draft (num_draft_tokens 0): the drafter does not run for
        them at all. At `k_next` 0 the drafter does not run: the rows wait for a later pass (deferred_context.py;
        without deferral it runs its context pass alone); either way its cache follows every token, so drafting
        can resume at any step. Else each keeps at most `k_next` drafts, drafted after any held rows ran.
        `staged`: an overlapped decode step's rows, already copied into the held context's log from there on."""
        assert self.proposer is not None and features is not None
        num_drafts, drafting = self.proposer.num_drafts, k_next != 0
        entries = [
            ProposeEntry(o.request, o.row_start, o.num_rows, o.verified_rows, drafting and proposes_now(o.request))
            for o in outcomes
            if o.request.status is Status.RUNNING and num_drafts(o.request) > 0
        ]
        deferred = self.deferred
        held: list[Request] = []  # requests whose held rows run in this proposal (failed with it if it fails)
        try:
            if deferred is not None and staged is not None:
                deferred.hold(entries, staged)
                return
            if deferred is not None and not drafting and deferred.defer(entries, features):
                return
            batch = ProposeBatch(entries, features, self.scheduler.reserve)
            if deferred is not None and deferred.held:
                held = [h.request for h in deferred.held.values()]
                self._flushed = (not drafting, deferred.steps + 1)
                batch = deferred.flush(batch, at_zero=not drafting)
            self.proposer.propose(batch)
        except Exception as err:  # a request whose held rows did not run is failed with the step's
            held += [h.request for h in deferred.held.values()] if deferred is not None else []
            self._fail(list({r.request_id: r for r in [e.request for e in entries] + held}.values()), err)
            return
        for entry in entries:
            cap_drafts(entry.request, k_next)

    def _cache_prefixes(self, requests: list[Request]) -> None:
        """Register the prompt blocks whose K/V this step finished writing (prefix_cache.py). One key stands
        for the target's and the drafter's K/V of a block, so only requests the drafter ran for register, and
        only up to their first held row (deferred_context.py)."""
        prefix_cache = self.scheduler.prefix_cache
        if prefix_cache is None:
            return
        for request in requests:
            if request.status is Status.RUNNING and (self.proposer is None or self.proposer.num_drafts(request)):
                prefix_cache.cache_blocks(request, self.deferred.written(request) if self.deferred else None)

    def _bad_drafts(self) -> list[tuple[Request, BaseException]]:
        """Running requests with draft ids outside the vocabulary (a faulty drafter), caught before the
        target embeds them, where one such id fails the whole step (on CUDA, the process). Host lists: no
        device work, no sync."""
        if self.proposer is None:
            return []
        vocab = self.runner.model.config.vocab_size
        found = [(r, check_drafts(r.draft_ids, vocab)) for r in self.scheduler.running if r.draft_ids]
        return [(r, err) for r, err in found if err is not None]

    def _fail_alone(self, failures: list[tuple[Request, BaseException]]) -> None:
        """Finish each request with its own error; the rest of the batch goes on."""
        for request, err in failures:
            log.error("request %s failed: %s", request.request_id[:64], err)
            self._finish(request, None, error=err)

    def _fail(self, requests: list[Request], err: BaseException) -> None:
        log.exception("step failed; failing its %d requests", len(requests), exc_info=err)
        for request in requests:
            if request.status is not Status.FINISHED:
                self._finish(request, None, error=err)
        self._flush_outbox()

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self._live.get(rid)
            if request is not None and request.status is not Status.FINISHED:
                self._finish(request, "abort")

    def _finish(
        self,
        request: Request,
        reason: str | None,
        new_tokens: list[int] | None = None,
        error: BaseException | None = None,
        num_drafted: int = 0,
        num_accepted: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.scheduler.remove(request)
        if self.proposer is not None:
            self.proposer.forget(request)
        if self.deferred is not None:
            self.deferred.drop(request)
        if self.spec_step is not None:
            self.spec_step.table.release(request.request_id)
        if self.overlap is not None:
            self.overlap.release(request.request_id)
        if self.speculation is not None:  # its own acceptance: only live requests are planned for
            self.speculation.forget_request(request.request_id)
        with self._lock:
            self._live.pop(request.request_id, None)
        finish: Finish | None = request.finish(reason) if reason is not None else None
        output = RequestOutput(request.request_id, new_tokens or [], num_drafted, num_accepted, finish, error, logprobs)
        self._outbox.append((request.sink, output))

    def _flush_outbox(self) -> None:
        """Hand out what the last step produced. Deferred until the next step is launched, so the callers'
        work on these outputs (gRPC streaming, on the same GIL) overlaps the device instead of delaying it."""
        outbox, self._outbox = self._outbox, []
        for sink, output in outbox:
            sink(output)


def proposes_now(request: Request) -> bool:
    """Whether the request drafts after this step (when the step after it drafts at all): it has a new last token,
    not a prefill chunk mid-prompt."""
    return request.num_computed_tokens == request.num_tokens - 1


def cap_drafts(request: Request, k: int | None) -> None:
    """Keep the request's first `k` drafts (None: all); a chain's or a tree's first drafts are a chain or a tree."""
    if k is not None and len(request.draft_ids) > k:
        request.draft_ids = request.draft_ids[:k]
        request.draft_probs = request.draft_probs.head(k) if request.draft_probs is not None else None

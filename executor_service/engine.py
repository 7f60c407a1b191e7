"""The engine: continuous batching on its own thread.

Callers (the asyncio gRPC servicer, tests, benchmarks) only `add` requests and `abort` them; both are
thread-safe and never wait on the device. The engine thread owns the scheduler and the cache, runs
`step()` while there is work, and hands each request's new tokens to the request's sink.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

import torch

from executor_service.adaptive_k import AdaptiveK
from executor_service.host_verify import VerifyError, check_drafts, verify_on_host
from executor_service.logprobs import TokenLogprob, batch_logprobs
from executor_service.model_runner import ModelRunner, StepInputs
from executor_service.proposer import ProposeBatch, ProposeEntry, Proposer
from executor_service.request import Finish, Request, RequestOutput, Sink, Status
from executor_service.scheduler import ScheduledStep, Scheduler
from executor_service.spec_step import PendingStep, SpecStep

log = logging.getLogger("specdec.engine")

StepObserver = Callable[[int, int, float], None]  # (tokens computed, tokens generated, seconds)
VerifyObserver = Callable[[list[int], list[int]], None]  # per verified request: (drafts, accepted drafts)


class Engine:
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
    ) -> None:
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.on_step, self.proposer, self.on_verify = on_step, proposer, on_verify
        self.spec_step = spec_step  # verify + accept + propose on the device, for uniform greedy steps
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}  # every request not yet finished, by id
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[Sink, RequestOutput]] = []  # in order; see _flush_outbox
        self._in_flight: tuple[list[Request], PendingStep] | None = None  # see _book_on_device
        # The drafts each step verifies, chosen from measured costs (adaptive_k.py); None: always the loaded k.
        self.speculation = speculation
        self._steady: tuple[int, int] | None = None  # this step's (batch, k) when it ran steadily at one k

    # ---- called from any thread -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort whatever is still live (its sinks get finish "abort"), then stop the thread."""
        self.abort(self.live_ids())
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def add(self, request: Request) -> None:
        """Queue a request the caller has checked (validation.py); KeyError if its id is live."""
        with self._lock:
            if request.request_id in self._live:
                raise KeyError(request.request_id)
            self._live[request.request_id] = request
        self._submit(lambda: self.scheduler.add(request))

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Stop these requests (finish "abort"); returns the ids that were still live."""
        with self._lock:
            found = [rid for rid in request_ids if rid in self._live]
        if found:
            self._submit(lambda: self._abort(found))
        return found

    def run_until_idle(self, before_step: Callable[[int], None] | None = None) -> None:
        """Step on the caller's thread until no work is left; only before start() (warm-up, tests).
        `before_step(n)` runs before the n-th step (from 0) and may raise to stop: the warm-up's step bound
        and its cancellation at shutdown."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is running")
        self._drain_commands()
        steps = 0
        while self._has_work():
            if before_step is not None:
                before_step(steps)
            steps += 1
            self.step()
            self._drain_commands()
        self._flush_outbox()

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- the engine thread -------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_commands()
            if self._has_work():
                self.step()
            else:
                self._flush_outbox()
                self._wake.wait()
        self._drain_commands()
        self._flush_outbox()

    def _has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def step(self) -> None:
        """One step (`_step`); a step that ran steadily at one k gives the speculation its wall time."""
        started = time.perf_counter()
        self._steady = None
        self._step(started)
        if self.speculation is not None and self._steady is not None:
            self.speculation.record(*self._steady, time.perf_counter() - started)

    def _step(self, started: float) -> None:
        """One step, in the order a reader follows: schedule, run the target once, verify (verify_on_host: greedy
        or rejection sampling), accept (roll back rejected drafts' K/V), emit the tokens, propose the next drafts.
        A uniform greedy step does all of it on the device instead (_step_on_device, spec_step.py)."""
        if self._in_flight is not None:  # a device-resident step launched behind the last one: book it
            requests, pending = self._in_flight
            self._in_flight = None
            try:
                self._book_on_device(requests, pending, started)
            except Exception as err:
                self._fail(requests, err)
            return
        self._fail_alone(self._bad_drafts())
        scheduled = self.scheduler.schedule()
        self._fail_alone(scheduled.failed)  # requests that can never fit the cache
        if not scheduled:
            return
        try:
            inputs = self.runner.prepare(scheduled)
            if self.spec_step is not None and self.spec_step.accepts(inputs, scheduled.requests):
                self._step_on_device(scheduled, inputs, started)
                return
            output = self.runner.execute(inputs)
            self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
            sampled = [scheduled.requests[i] for i in inputs.sampled]
            drafts = [r.draft_ids for r in sampled]
            settings = [r.settings for r in sampled]
            verdicts = verify_on_host(output.logits, sampled, drafts, [r.draft_probs for r in sampled])
            emitted = [v if isinstance(v, VerifyError) else v.emitted for v in verdicts]
            found = batch_logprobs(output.logits, settings, drafts, emitted)  # the target's, for who asks
            logprobs = {id(r): request_logprobs for r, request_logprobs in zip(sampled, found, strict=True)}
        except Exception as err:  # a kernel or device failure fails this step's requests, not the server
            self._fail(scheduled.requests, err)
            return
        sampled, drafts, emitted = self._drop_failed(sampled, drafts, emitted)
        kept = self._accept(scheduled, sampled, drafts, emitted)
        if self.proposer is None:  # the K/V is all written: register before a finish frees the blocks
            self._cache_prefixes(scheduled.requests)
        generated = 0
        for request, request_drafts, tokens in zip(sampled, drafts, emitted, strict=True):
            generated += self._emit(request, tokens, len(request_drafts), logprobs[id(request)])
        if self.proposer is not None:
            k_next = self._plan(scheduled.requests)
            rows = scheduled.num_new_tokens
            self._propose(scheduled.requests, inputs.row_starts, rows, kept, output.features, k_next)
            self._cache_prefixes(scheduled.requests)  # once the drafter wrote its K/V too
            if len(sampled) == len(scheduled.requests):
                self._note_steady(len(sampled), {len(d) for d in drafts}, k_next)
        if self.on_step is not None:
            self.on_step(scheduled.num_tokens, generated, time.perf_counter() - started)
        self._observe_verify([len(d) for d in drafts], [len(t) - 1 for t in emitted])

    def _accept(
        self, scheduled: ScheduledStep, sampled: list[Request], drafts: list[list[int]], emitted: list[list[int]]
    ) -> dict[int, int]:
        """Book the verification: each request keeps its computed rows up to its last accepted draft (the
        rejected drafts' K/V are rolled back by not counting them). Returns the rows kept, by id(request)."""
        kept = {id(r): n for r, n in zip(scheduled.requests, scheduled.num_new_tokens, strict=True)}
        for request, request_drafts, tokens in zip(sampled, drafts, emitted, strict=True):
            accepted = len(tokens) - 1
            kept[id(request)] -= len(request_drafts) - accepted
            if request_drafts:
                request.record_verification(len(request_drafts), accepted)
            request.draft_ids, request.draft_probs = [], None
        for request in scheduled.requests:
            request.num_computed_tokens += kept[id(request)]
        return kept

    def _step_on_device(self, scheduled: ScheduledStep, inputs: StepInputs, started: float) -> None:
        """Every request verifies k drafts (greedy, sampled, penalised, with logprobs): verification, acceptance
        and the next proposal run on the device as one pass (spec_step.py); the host books what it reads back."""
        assert self.spec_step is not None
        self._book_on_device(scheduled.requests, self.spec_step.launch(inputs, scheduled.requests), started)

    def _book_on_device(self, requests: list[Request], pending: PendingStep, started: float) -> None:
        """Book a device-resident step. When the same batch can go on, the step after it is launched first,
        its inputs derived on the device, so the device runs it while the host reads this one back and books
        it: one read-back per step, overlapped with the next step."""
        assert self.spec_step is not None and self.proposer is not None
        k_next = self._plan(requests)
        following = self._launch_following(requests, pending) if k_next in (None, self.spec_step.k) else None
        self._flush_outbox()  # the previous step's outputs go out while this one runs on the device
        result = pending.result()
        generated, drafted, accepted = 0, [], []
        for index, request in enumerate(requests):
            if request.status is not Status.RUNNING:  # finished while a following step was in flight
                continue
            num_drafts = len(request.draft_ids)
            request.num_computed_tokens += result.kept_rows(index)  # roll back: rejected drafts' K/V not kept
            request.record_verification(num_drafts, result.accepted[index])
            request.draft_ids = []
            drafted.append(num_drafts)
            accepted.append(result.accepted[index])
            logprobs = result.token_logprobs(index, request.settings.logprobs)
            generated += self._emit(request, result.emitted(index), num_drafts, logprobs)
            self.spec_step.table.booked(request)  # after _emit: the step counted what it appended
            if request.status is Status.RUNNING:
                self.proposer.set_drafts(request, result.next_drafts[index])
                cap_drafts(request, k_next)
        self._cache_prefixes(requests)
        if following is not None:
            self._in_flight = (requests, following)
        self._note_steady(len(drafted), set(drafted), k_next)
        if self.on_step is not None:
            self.on_step(len(requests) * (self.spec_step.k + 1), generated, time.perf_counter() - started)
        self._observe_verify(drafted, accepted)

    # ---- adaptive speculation (adaptive_k.py) ---------------------------------------------------
    def _plan(self, requests: list[Request]) -> int | None:
        """The drafts per request of the next step for these requests' batch; None: the loaded k, always."""
        if self.speculation is None:
            return None
        return self.speculation.plan(sum(r.status is Status.RUNNING for r in requests) or 1)

    def _note_steady(self, batch: int, verified: set[int], k_next: int | None) -> None:
        """A step whose every request verified k drafts and drafted k for the next step measures k's cost."""
        if k_next is not None and batch and verified == {k_next}:
            self._steady = (batch, k_next)

    def _observe_verify(self, drafted: list[int], accepted: list[int], depths: list[int] | None = None) -> None:
        """Per verified request (drafts, accepted, and for trees the depth reached): metrics and the speculation."""
        if not any(drafted):
            return
        if self.on_verify is not None:
            self.on_verify(drafted, accepted)
        if self.speculation is not None:
            pairs = [(d, a) for d, a in zip(depths or drafted, accepted, strict=True) if d]
            self.speculation.observe_verify([d for d, _ in pairs], [a for _, a in pairs])

    def _launch_following(self, requests: list[Request], pending: PendingStep) -> PendingStep | None:
        """The step after `pending`, launched before `pending` is read back, when nothing could change the
        batch in between: no command or waiting request, nobody finished, every request's blocks reserved
        far enough ahead and its context long enough. Scripted drafts (`proposer.replay`) need the host."""
        assert self.spec_step is not None and self.proposer is not None
        if self.proposer.replay is not None or self.scheduler.waiting or not self._commands.empty():
            return None
        if any(r.status is not Status.RUNNING or self.spec_step.reach(r) > self.max_model_len for r in requests):
            return None
        if not all(self.scheduler.reserve(r, self.spec_step.reach(r)) for r in requests):
            return None
        return self.spec_step.launch_following(pending, requests)

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
        self,
        requests: list[Request],
        row_starts: list[int],
        num_new: list[int],
        kept: dict[int, int],
        features: torch.Tensor | None,
        k_next: int | None = None,
    ) -> None:
        """Draft for the next step from this step's target features. Requests that finished are skipped, and so
        are those that never draft (num_speculative_tokens 0): the drafter does not run for them at all. At
        `k_next` 0 the drafter runs its context pass alone (its cache follows every token, so drafting can resume
        at any step); else each request keeps at most `k_next` drafts (None: its own k)."""
        assert self.proposer is not None and features is not None
        entries = [
            ProposeEntry(r, start, rows, kept[id(r)], propose=r.num_computed_tokens == r.num_tokens - 1 and k_next != 0)
            for r, start, rows in zip(requests, row_starts, num_new, strict=True)
            if r.status is Status.RUNNING and self.proposer.num_drafts(r) > 0
        ]
        running = [e.request for e in entries]
        try:
            self.proposer.propose(ProposeBatch(entries, features))
        except Exception as err:
            self._fail(running, err)
            return
        for request in running:
            cap_drafts(request, k_next)

    def _cache_prefixes(self, requests: list[Request]) -> None:
        """Register the prompt blocks whose K/V this step finished writing (prefix_cache.py). One key stands
        for the target's and the drafter's K/V of a block, so only requests the drafter ran for register."""
        prefix_cache = self.scheduler.prefix_cache
        if prefix_cache is None:
            return
        for request in requests:
            if request.status is Status.RUNNING and (self.proposer is None or self.proposer.num_drafts(request)):
                prefix_cache.cache_blocks(request)

    def _bad_drafts(self) -> list[tuple[Request, BaseException]]:
        """Running requests with draft ids outside the vocabulary (a faulty drafter), caught before the
        target embeds them, where one such id fails the whole step (on CUDA, the process). Host lists: no
        device work, no sync."""
        if self.proposer is None:
            return []
        vocab = self.runner.model.config.vocab_size
        found = [(r, check_drafts(r.draft_ids, vocab)) for r in self.scheduler.running if r.draft_ids]
        return [(r, err) for r, err in found if err is not None]

    def _drop_failed(
        self, sampled: list[Request], drafts: list[list[int]], emitted: list
    ) -> tuple[list[Request], list[list[int]], list[list[int]]]:
        """Fail the requests whose own verification failed (a VerifyError in `emitted`); keep the others."""
        self._fail_alone([(r, e) for r, e in zip(sampled, emitted, strict=True) if isinstance(e, Exception)])
        keep = [i for i, e in enumerate(emitted) if not isinstance(e, Exception)]
        return [sampled[i] for i in keep], [drafts[i] for i in keep], [emitted[i] for i in keep]

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
        if self.spec_step is not None:
            self.spec_step.table.release(request.request_id)
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


def cap_drafts(request: Request, k: int | None) -> None:
    """Keep the request's first `k` drafts (None: all); a chain's or a tree's first drafts are a chain or a tree."""
    if k is not None and len(request.draft_ids) > k:
        request.draft_ids = request.draft_ids[:k]
        request.draft_probs = request.draft_probs.head(k) if request.draft_probs is not None else None

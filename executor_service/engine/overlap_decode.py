"""Decode steps overlapped with their booking: vLLM's async scheduling, SGLang's overlap scheduler. Target-only
steps, and with a drafter the steps of adaptive speculation's k = 0 (below).

Without a drafter, a decode step used to run its host work (building the inputs, reading the sampled tokens back,
booking, streaming) while the device idled: on an H100, SmolLM2-135M's batch-1 step is a 0.66 ms graph replay
but 1.21 ms a token. Here a steady decode step samples its tokens on the device, and the step after it is launched
before the host reads them back: its input ids are those tokens (a device-to-device copy), its positions, slots,
sequence lengths and block table follow on the host from the requests' counts (none depends on the token), its
K/V slot reserved ahead. The host then reads the step back and books it while the device runs the next one; the
engine books that one at its next step (engine.py: `_decode_overlapped`).

Tokens are the host path's bit for bit: sampling is verifier.verify with no drafts, called as host_verify calls it
(greedy rows: the argmax; sampled rows: the counter-based draw keyed by seed and position, device_sampling.py),
on CUDA one graph replay instead of some sixty launches (sampler_graphs.py).
Requests with penalties (or a logit bias) or logprobs overlap too: each penalised request owns a slot of a penalty
table on the device (spec_decode/device_penalties.py, as the device step keeps them), the draw penalises its row
from the slot and counts the drawn token there, so the step launched before the read-back is penalised for it; the
host uploads only tokens emitted off this path (a prefill, a serial step, a device step with its own table). Each
token's raw logprobs and the top ones come back with it.

With a drafter, a decode step that adaptive speculation planned at k = 0 is launched so too (engine.py). At its
booking the next step's k is planned first; only k = 0 goes on: the step's feature rows are copied into the held
drafter context's log (deferred_context.py, `stage`) before the step after it is launched, whose graph replay
overwrites them, and held once the step is booked. Where they cannot be staged (a request's held rows at their
bound, the log full) or the plan drafts, nothing is launched after it, and the engine books it as the host path
would (deferring, flushing or drafting from its features, still in place). The steps after reserve the drafter's
lookahead as the scheduler does, so a switch to drafting at any booking finds its slots.

A request that stops at step n (a stop token, EOS) had its row in step n + 1 launched already: the row is dropped
unread, and its one K/V write lands in a block freed at n's booking, before any later step (stream order) could
reuse the block; the position is past its computed tokens, so the prefix cache never registers it (it registers
prompt blocks only, up to the computed tokens). Requests that reach max_tokens or the context at step n are left
out of step n + 1 up front. A request the scheduler would admit (an arrival, a preempted one, a queue behind a full
batch once a request finishes) and pending commands end the chain: the step in flight is booked, the next one is
scheduled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from executor_service.engine.outcome import StepOutcome
from executor_service.engine.request import Request, Status
from executor_service.engine.sampler_graphs import HostExtras, SamplerGraphs, eager_draw
from executor_service.engine.scheduler import ScheduledStep, Scheduler
from executor_service.models.attention_step import AttentionStep, block_table_tensor, cache_slot, to_device
from executor_service.models.fused_ops import packed_checked_argmax
from executor_service.runner.host_copy import HostCopy
from executor_service.runner.model_runner import ModelRunner, StepInputs
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.sampling import host_sort, needs_sort
from executor_service.spec_decode.device_penalties import PenaltyTable, logprob_width, penalty_params, unpack_logprobs
from executor_service.spec_decode.host_verify import NOT_A_DISTRIBUTION, NOT_FINITE, VerifyError
from executor_service.spec_decode.step_variants import DEFAULT_PENALTY_SLOTS


@dataclass
class LaunchedDecode:
    """A decode step launched with its sampling; `tokens` [B] stay on the device for the step after it."""

    requests: list[Request]  # its rows, in order
    tokens: torch.Tensor  # each row's sampled token
    checks: HostCopy  # [finite (B) | a distribution (B; sampled steps only) | tokens (B) | logprobs (B x W)]
    ahead: bool  # launched before the step before it was read back
    features: torch.Tensor | None = None  # what a drafter reads of each row (a graph's: until the next replay)
    staged: int | None = None  # with a drafter at k = 0: where its feature rows went in the held context's log
    logprob_width: int = 0  # W: each token's packed logprobs (a batch with extras), 0 without

    def live(self) -> bool:
        """Whether any of its requests still runs (else nothing of it would be booked)."""
        return any(r.status is Status.RUNNING for r in self.requests)


def has_extras(request: Request) -> bool:
    """A request whose token needs what the host path reads from its history: a penalty or a logit bias (its token
    counts), or logprobs."""
    settings = request.settings
    return settings.has_penalties or settings.logprobs is not None


class DecodeOverlap:
    """Launches steady decode steps and the steps after them (the module's docstring); the engine books them.
    Requests with penalties or logprobs overlap too, their counts kept in a penalty table of its own on the device
    (beside the device step's, if any: each table counts what its own steps drew and uploads the rest when a
    request comes back to it)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, max_model_len: int) -> None:
        self.runner, self.scheduler, self.max_model_len = runner, scheduler, max_model_len
        self.constants = StepConstants(runner.device)
        self.sampler: SamplerGraphs | None = None
        # Its tensors are allocated at load where the sampler graphs are captured, else at the first batch with extras.
        self.table = PenaltyTable(DEFAULT_PENALTY_SLOTS, runner.model.config.vocab_size, runner.device)

    def applies(self, scheduled: ScheduledStep) -> bool:
        """A steady decode step: every running request decodes one token (no prompt chunk, no drafts), nobody
        could be admitted, preempted or failed, every request overlaps, and some request goes on after the step.
        (The engine checks for pending commands.)"""
        if scheduled.preempted or scheduled.failed or self._admits():
            return False
        if len(scheduled.requests) != len(self.scheduler.running):
            return False
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            decoding = num_new == 1 and request.num_computed_tokens == request.num_tokens - 1
            if not decoding or request.draft_ids or request.status is not Status.RUNNING:
                return False
        if not self.table.fits(scheduled.requests):  # a penalised request without a slot to take
            return False
        return any(not self._ends_by_length(r) for r in scheduled.requests)

    def booked(self, requests: list[Request]) -> None:
        """A step's tokens are in its requests' outputs: the step counted them in their slots too."""
        for request in requests:
            self.table.booked(request)

    def release(self, request_id: str) -> None:
        """The request finished: its penalty slot is free (filled afresh when given out again)."""
        self.table.release(request_id)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, requests: list[Request]) -> LaunchedDecode:
        """Queue the scheduled step (runner.prepare's inputs), its sampling and its read-back."""
        output = self.runner.execute(inputs)
        roots = [r.num_computed_tokens for r in requests]  # each row's position: its random numbers' key
        return self._sampled(output.logits, requests, roots, ahead=False, features=output.features)

    @torch.inference_mode()
    def launch_following(self, step: LaunchedDecode) -> LaunchedDecode | None:
        """Queue the step after `step` before the host reads `step` back, for its requests that still run and go
        on after it, when nobody could be admitted and no other request runs; None: the next step is scheduled.
        (The engine checks for pending commands.)"""
        if self._admits():
            return None
        running = [i for i, r in enumerate(step.requests) if r.status is Status.RUNNING]
        if len(running) != len(self.scheduler.running):  # another request joined: the scheduler decides
            return None
        rows = [i for i in running if not self._ends_by_length(step.requests[i])]
        requests = [step.requests[i] for i in rows]
        # Positions: `step`'s rows sit at the computed tokens (its predecessors are booked); the next ones past.
        positions = [r.num_computed_tokens + 1 for r in requests]
        if not rows or not all(
            self.scheduler.reserve(r, self._reach(r, p)) for r, p in zip(requests, positions, strict=True)
        ):
            return None
        if len(rows) == len(step.requests):
            input_ids = step.tokens
        else:
            input_ids = step.tokens.index_select(0, to_device(rows, torch.int64, step.tokens.device))
        output = self.runner.execute(self.decode_inputs(requests, positions, input_ids))
        return self._sampled(output.logits, requests, positions, ahead=True, features=output.features)

    def outcomes(self, step: LaunchedDecode) -> tuple[list[StepOutcome], list[tuple[Request, BaseException]]]:
        """Read the step back (waits for the device): each still running request's outcome (one token, its K/V
        kept), and those whose logits or distribution were not sound (failed alone, as the host path's)."""
        host = step.checks.wait()
        count = len(step.requests)
        sampled = host.shape[0] != 2 * count  # a greedy step reads back [finite | tokens]
        values = host[: 3 * count if sampled else 2 * count].tolist()
        finite, tokens = values[:count], values[-count:]
        valid = values[count : 2 * count] if sampled else [1] * count
        logprobs = host[3 * count :].view(count, step.logprob_width) if step.logprob_width else None
        top = (step.logprob_width - 1) // 2
        outcomes, failed = [], []
        rows = zip(step.requests, finite, valid, tokens, strict=True)
        for row, (request, ok, distribution, token) in enumerate(rows):
            if request.status is not Status.RUNNING:  # finished meanwhile (a stop, an abort): its row is dropped
                continue
            if not ok or not distribution:
                failed.append((request, VerifyError(NOT_FINITE if not ok else NOT_A_DISTRIBUTION)))
                continue
            asked = request.settings.logprobs
            token_logprobs = None
            if logprobs is not None and asked is not None:
                token_logprobs = unpack_logprobs(logprobs[row], [token], top, asked)
            outcome = StepOutcome(request, request.num_computed_tokens + 1, [token], logprobs=token_logprobs)
            outcome.row_start, outcome.num_rows, outcome.verified_rows = row, 1, [row]  # a drafter reads its row
            outcomes.append(outcome)
        return outcomes, failed

    def _admits(self) -> bool:
        """Whether the scheduler would admit a waiting request now: someone waits and the batch has room. A queue
        behind a full batch (max_num_seqs) waits for a finish as it would on the serial path; the finish ends the
        chain, and the next step admits."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.scheduler.max_num_seqs

    def _reach(self, request: Request, position: int) -> int:
        """Positions a step at `position` reserves, as the scheduler reserves for a decode step: its K/V slot and,
        with a drafter (k = 0 steps), the lookahead its proposal writes should the step after it draft."""
        return min(position + 1 + self.scheduler.lookahead(request), self.max_model_len)

    def _ends_by_length(self, request: Request) -> bool:
        """Whether its token of the step in hand (not yet booked) is its last by max_tokens or the context."""
        return len(request.output_ids) + 1 >= request.max_tokens or request.num_tokens + 1 >= self.max_model_len

    def decode_inputs(self, requests: list[Request], positions: list[int], input_ids: torch.Tensor) -> StepInputs:
        """A decode step's inputs as runner.prepare builds them, the input ids given on the device: one row per
        request at `positions`, every row sampled."""
        count, device = len(requests), self.runner.device
        slots = [cache_slot(r.block_ids, p, self.runner.block_size) for r, p in zip(requests, positions, strict=True)]
        seq_lens = [p + 1 for p in positions]
        host = to_device(positions + slots + seq_lens, torch.int64, device)
        attention = AttentionStep(
            backend=self.runner.backend,
            block_table=block_table_tensor([r.block_ids for r in requests], device),
            query_start_loc=self.constants.starts(count, 1),
            seq_lens=host[2 * count :].to(torch.int32),
            slot_mapping=host[count : 2 * count],
            max_query_len=1,
            max_seq_len=max(seq_lens),
        )
        rows = list(range(count))
        return StepInputs(
            input_ids=input_ids,
            positions=host[:count],
            attention=attention,
            logits_indices=self.constants.arange(count),
            sampled=rows,
            num_drafts=[0] * count,
            row_starts=rows,
            uniform_query_len=1,
        )

    def _sampled(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        roots: list[int],
        ahead: bool,
        features: torch.Tensor | None,
    ) -> LaunchedDecode:
        """Sample each row as the host path does (host_verify.verify_on_host with no drafts: the same checks, the
        same verify call) and queue the read-back. `roots`: each row's position, its draws' key."""
        settings = [r.settings for r in requests]
        count = len(requests)
        if all(s.plain_greedy for s in settings):
            packed = packed_checked_argmax(logits)  # verifier.verify_greedy's token after no drafts
            return LaunchedDecode(requests, packed[count:], HostCopy(packed), ahead, features)
        seeds, vocab = [r.seed for r in requests], logits.shape[-1]
        extras = self._extras(requests) if any(has_extras(r) for r in requests) else None
        sampler = self._sampler(logits.is_cuda)
        if sampler is not None:
            packed = sampler.draw(logits, settings, seeds, roots, needs_sort(settings, vocab), extras)
        else:
            packed = eager_draw(logits, settings, seeds, roots, host_sort(settings, vocab), extras)
        width = logprob_width(vocab) * 2 + 1 if extras is not None else 0
        tokens = packed[2 * count : 3 * count]
        return LaunchedDecode(requests, tokens, HostCopy(packed), ahead, features, logprob_width=width)

    def _extras(self, requests: list[Request]) -> HostExtras:
        """The batch's penalty slots (assigning new ones, uploading tokens counted nowhere yet) and parameters."""
        self.table.allocate()  # the draw reads the table (the bias rows) even where no request is penalised
        return HostExtras(self.table, self.table.slots_of(requests), penalty_params(requests))

    def captures(self) -> Counter[str]:
        """The sampler graphs captured so far (slow_steps.py reports a step that captured one)."""
        return Counter(graphs=self.captured())

    def captured(self) -> int:
        """How many sampler graphs are captured (read every step with adaptive speculation: no Counter built)."""
        return len(self.sampler.graphs) if self.sampler is not None else 0

    def capture_sampler(self) -> None:
        """At load: every bucket's sampled draws captured (SamplerGraphs.capture_all), where the target's
        decode step is a graph (CUDA)."""
        sampler = self._sampler(self.runner.device.type == "cuda")
        if sampler is not None:
            sampler.capture_all(self.table)

    def _sampler(self, on_cuda: bool) -> SamplerGraphs | None:
        """The sampled draws' graphs where the target's decode step is a graph too (CUDA)."""
        decode_graphs = self.runner.graphs.get(1)
        if decode_graphs is None or not on_cuda:
            return None
        if self.sampler is None:
            self.sampler = SamplerGraphs(decode_graphs.max_batch)
        return self.sampler

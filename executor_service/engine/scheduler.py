"""Continuous batching: which requests run this step and with how many tokens.

vLLM v1's shape: no prefill or decode phases, just "tokens to compute" per request. Running requests go
first (a decode is one token, an unfinished prefill its next chunk), then waiting requests are admitted
while the step's token budget and the KV cache allow. When a running request cannot grow, the most
recently admitted one is preempted: its blocks are freed and it will be recomputed from its tokens.
With prefix caching, a request leaving the queue first takes the cached blocks of its prompt's prefix
(prefix_cache.py) and computes only the rest.
A request that cannot fit even with the whole cache to itself is failed, never preempted or retried
forever (admission should have refused it: `speculative_headroom`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from executor_service.engine.block_pool import BlockPool
from executor_service.engine.kv_cache import blocks_needed
from executor_service.engine.prefix_cache import PrefixCache
from executor_service.engine.request import Request, Status
from executor_service.errors import RequestTooLarge


def speculative_headroom(num_draft_tokens: int, num_lookahead_tokens: int) -> int:
    """KV slots past prompt + max_tokens that a request may hold at its last speculative step: it is then
    scheduled with up to prompt + max_tokens - 1 tokens, num_draft_tokens drafts to verify and the drafter's
    lookahead.
    Admission counts them (validation.check_generate), so a request alone in the cache always fits."""
    return num_draft_tokens + num_lookahead_tokens - 1 if num_lookahead_tokens else 0


@dataclass
class ScheduledStep:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)  # out of the queues; finish them

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(
        self,
        allocator: BlockPool,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.allocator = allocator
        self.prefix_cache = prefix_cache  # None: prefix caching off
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_lookahead_tokens = num_lookahead_tokens  # slots a speculative step writes past the tokens
        self.max_model_len = max_model_len  # nothing is written or read past the context: no slots beyond
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.draft_ids:  # verify the drafts with the last token, as many as the budget allows
                del request.draft_ids[max(budget - 1, 0) :]
            num_new = min(request.num_tokens - request.num_computed_tokens + len(request.draft_ids), budget)
            if not self._grow(request, num_new):
                if len(self.running) == 1:  # the whole cache is its own: it can never grow
                    self.running.remove(request)
                    self._fail(request, step)
                    continue
                victim = self.running[-1]  # the latest admitted goes back to the queue
                self._preempt(victim, step)
                continue  # retry with the freed blocks (or move on, if the victim was this request)
            step.requests.append(request)
            step.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1
        if step.preempted:
            return step  # the cache is tight: admit nobody this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.prefix_cache.computed_blocks(request) if self.prefix_cache is not None else []
            num_new = min(request.num_tokens - len(cached) * self.block_size, budget)
            if not self._grow(request, num_new, cached):
                if not self.running:  # nothing holds blocks: it will never fit
                    self.waiting.popleft()
                    self._fail(request, step)
                    continue
                break  # first come, first served: no overtaking of a request that does not fit yet
            self.waiting.popleft()
            if self.prefix_cache is not None:
                self.prefix_cache.admitted(request, cached)
            request.status = Status.RUNNING
            self.running.append(request)
            step.requests.append(request)
            step.num_new_tokens.append(num_new)
            budget -= num_new
        return step

    def _grow(self, request: Request, num_new: int, cached: list[int] | None = None) -> bool:
        """Give `request` the blocks for its computed tokens, `num_new` more and the lookahead slots. `cached`:
        a request leaving the queue takes these prefix blocks first (its computed tokens, once taken)."""
        cached = cached or []
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new
        if total == request.num_tokens + len(request.draft_ids):  # it will sample: the drafter writes ahead
            total += self.lookahead(request)
            if self.max_model_len is not None:
                total = min(total, self.max_model_len)
        return self.reserve(request, total, cached)

    def lookahead(self, request: Request) -> int:
        """Slots the request's proposals write past its tokens: its own (per-request speculation), else the
        loaded drafter's."""
        own = request.num_lookahead_tokens
        return self.num_lookahead_tokens if own is None else own

    def reserve(self, request: Request, positions: int, cached: list[int] | None = None) -> bool:
        """Blocks for the request's first `positions` positions, if free ones are there (no preemption): the
        engine reserves ahead before it launches a step whose inputs are still on the device. `cached`: take
        these prefix blocks first, only if the rest fits too (a free cached block taken is no longer free)."""
        cached = cached or []
        missing = blocks_needed(positions, self.block_size) - len(request.block_ids) - len(cached)
        if missing > self.allocator.num_free - self.allocator.num_free_among(cached):
            return False
        if cached:
            assert not request.block_ids, "only a request leaving the queue takes cached blocks"
            self.allocator.touch(cached)
            request.block_ids.extend(cached)
        if missing > 0:
            request.block_ids.extend(self.allocator.allocate(missing))
        return True

    def _fail(self, request: Request, step: ScheduledStep) -> None:
        """Hand a request that no amount of preemption lets grow to the engine, which fails it."""
        self.release(request)
        lookahead = self.lookahead(request)
        needed = request.num_tokens + len(request.draft_ids) + lookahead
        needed = min(needed, self.max_model_len) if self.max_model_len is not None else needed
        capacity = self.allocator.num_blocks * self.block_size
        ahead = f" ({lookahead} of them the speculative step's lookahead)" if lookahead else ""
        error = RequestTooLarge(
            f"request {request.request_id[:64]!r} needs KV slots for {needed} tokens{ahead}; the whole cache holds "
            f"{capacity}",
            field="sampling.max_tokens",
            description="more tokens than the whole KV cache holds",
        )
        step.failed.append((request, error))

    def _preempt(self, request: Request, step: ScheduledStep) -> None:
        self.running.remove(request)
        self.release(request)
        request.num_computed_tokens = 0
        request.draft_ids, request.draft_probs = [], None
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        step.preempted.append(request)

    def release(self, request: Request) -> None:
        """Return the request's blocks to the pool (finish, abort, error, preemption), exactly once. Cached
        prefix blocks keep their content for the next request with that prefix."""
        self.allocator.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def remove(self, request: Request) -> None:
        """Take a finished, aborted or failed request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status = Status.FINISHED

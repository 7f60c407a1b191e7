"""Continuous batching: which requests run this step and with how many tokens.

vLLM v1's shape: no prefill or decode phases, just "tokens to compute" per request. Running requests go
first (a decode is one token, an unfinished prefill its next chunk), then waiting requests are admitted
while the step's token budget and the KV cache allow. When a running request cannot grow, the most
recently admitted one is preempted: its blocks are freed and it will be recomputed from its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from executor_service.kv_cache import BlockAllocator, blocks_needed
from executor_service.request import Request, Status


@dataclass
class ScheduledStep:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_lookahead_tokens = num_lookahead_tokens  # slots a speculative step writes past the tokens
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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new):
                break  # first come, first served: no overtaking of a request that does not fit yet
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            step.requests.append(request)
            step.num_new_tokens.append(num_new)
            budget -= num_new
        return step

    def _grow(self, request: Request, num_new: int) -> bool:
        """Give `request` the blocks for its computed tokens, `num_new` more and the lookahead slots."""
        total = request.num_computed_tokens + num_new
        if total == request.num_tokens + len(request.draft_ids):  # it will sample: the drafter writes ahead
            total += self.num_lookahead_tokens
        missing = blocks_needed(total, self.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing):
            return False
        request.block_ids.extend(self.allocator.allocate(missing))
        return True

    def _preempt(self, request: Request, step: ScheduledStep) -> None:
        self.running.remove(request)
        self.release(request)
        request.num_computed_tokens = 0
        request.draft_ids = []
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        step.preempted.append(request)

    def release(self, request: Request) -> None:
        """Return the request's blocks to the allocator (finish, abort, error, preemption)."""
        self.allocator.free(request.block_ids)
        request.block_ids = []

    def remove(self, request: Request) -> None:
        """Take a finished, aborted or failed request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status = Status.FINISHED

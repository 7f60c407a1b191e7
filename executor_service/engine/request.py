"""One generation request as the engine tracks it, and what the engine hands back for it."""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from executor_service.sample.logprobs import TokenLogprob
from executor_service.sample.penalties import TokenCounts
from executor_service.sample.sampling import DraftProbs, SamplingSettings


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_per_position: tuple[float, ...] = ()
    verify_steps: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one step; `finish` on the last; `error` instead when the engine failed the request."""

    request_id: str
    token_ids: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    finish: Finish | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asks for them


Sink = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    settings: SamplingSettings
    max_tokens: int  # resolved: the request's own, or what is left of the context
    eos_token_ids: frozenset[int]
    sink: Sink
    # The key of its counter-based draws (device_sampling.py): its own seed, else a random one (63 bits: int64).
    seed: int = field(default_factory=lambda: random.getrandbits(63))
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    draft_ids: list[int] = field(default_factory=list)  # proposed for the next step to verify
    draft_probs: DraftProbs | None = None  # the distributions the drafts were drawn from; None: argmax drafts
    # The request's own speculation (GenerateRequest.num_speculative_tokens), resolved by the session: the drafts
    # it verifies per step (0: none; a chain's first drafts, or a prefix of the tree's nodes) and the drafter
    # cache slots its proposals write past its tokens. None: the loaded drafter's own numbers.
    num_draft_tokens: int | None = None
    num_lookahead_tokens: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # target steps that verified drafts
    # Verify steps whose accepted drafts reached position (depth) i + 1; divided by every verify step, so the
    # rates never rise with depth (steps whose chain or tree was shorter count as not reaching it).
    accepted_per_position: list[int] = field(default_factory=list)
    # Prefix caching (prefix_cache.py): the keys of its leading blocks, how many of its blocks are in the
    # cache (taken from it or registered), and the prompt tokens it found cached at its first admission.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    cached_prompt_tokens: int | None = None
    token_counts: TokenCounts | None = None  # for penalties, made at its first penalised step (penalties.py)

    def __post_init__(self) -> None:
        if self.settings.seed is not None:
            self.seed = self.settings.seed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]

    def stop_reason(self, max_model_len: int) -> str | None:
        """Why generation ends after the newest token, or None to go on."""
        last = self.output_ids[-1]
        if last in self.settings.stop_token_ids or (last in self.eos_token_ids and not self.settings.ignore_eos):
            return "stop"
        if len(self.output_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def record_verification(self, num_drafts: int, num_accepted: int, positions: int | None = None) -> None:
        """A verify step's stats: drafts verified and accepted, and for each of `positions` (a chain's drafts; a
        tree's depth) whether the accepted drafts reached it."""
        positions = num_drafts if positions is None else positions
        self.verify_steps += 1
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        missing = positions - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position += [0] * missing
        for i in range(min(positions, num_accepted)):
            self.accepted_per_position[i] += 1

    def finish(self, reason: str) -> Finish:
        return Finish(
            reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
            # docs/api.md: the share of verify steps whose accepted path reached depth d.
            acceptance_per_position=tuple(a / self.verify_steps for a in self.accepted_per_position),
            verify_steps=self.verify_steps,
            cached_prompt_tokens=self.cached_prompt_tokens or 0,
        )

"""A request's outcome of one step, as both paths of the step report it (the device step's read-back, the host
path's verification): each fact computed once, where the step knows it, and booked in one place
(Engine._book): the computed tokens (the accepted path kept, rejected drafts rolled back), the verification's
statistics, the emitted tokens with their stop checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_service.engine.request import Request
from executor_service.sample.logprobs import TokenLogprob


@dataclass
class StepOutcome:
    request: Request
    num_computed: int  # its computed tokens after the step: the K/V kept (the rest past them rolled back)
    emitted: list[int]  # the accepted drafts, then the token after them ([]: a prefill chunk mid-prompt)
    num_drafts: int = 0  # drafts it verified
    accepted: int = 0  # of which accepted
    depth: int = 0  # its deepest draft's depth (a chain's: num_drafts)
    logprobs: list[TokenLogprob] | None = None
    # The host path's: its rows of the step's target pass (first, count) and which of them were verified, in order
    # (the drafter's context pass reads them).
    row_start: int = 0
    num_rows: int = 0
    verified_rows: list[int] = field(default_factory=list)

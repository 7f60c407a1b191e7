"""A step's two parts: the running requests the device step can take and the requests beside them.

New requests arrive while others decode, so a scheduled step often mixes verify rows (each running request's
newest token and its drafts) with prompt chunks. The device step (spec_step.py) takes only requests that verify
a whole draft of the loaded shape (a tree's in its layout); rather than send the whole batch to the host path
for one newcomer, the engine runs those requests on the device step and the rest (prefill chunks, requests
drafting fewer, trees cut short) on the host path beside it, in the same engine step.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from executor_service.engine.request import Request
from executor_service.engine.scheduler import ScheduledStep

DRAFT_IDS = attrgetter("draft_ids")


def verifies_whole_draft(request: Request, num_new: int, rows: int) -> bool:
    """Whether the request's scheduled tokens are its newest token and a whole draft of `rows - 1` drafts."""
    pending = request.num_tokens - request.num_computed_tokens
    return num_new == rows and pending == 1 and len(request.draft_ids) == rows - 1


def split_for_device(
    scheduled: ScheduledStep, rows: int, takes: Callable[[Request], bool]
) -> tuple[ScheduledStep, ScheduledStep] | None:
    """(the requests verifying a whole draft that the device step `takes`, the others) when the step has both;
    None: one part only (the whole step goes one way), as in a step that verifies no drafts (a prefill, adaptive
    speculation's k = 0), told at once."""
    if not any(map(DRAFT_IDS, scheduled.requests)):  # no Python call per request: this runs every step
        return None
    device, beside = ScheduledStep(), ScheduledStep()
    for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
        part = device if verifies_whole_draft(request, num_new, rows) and takes(request) else beside
        part.requests.append(request)
        part.num_new_tokens.append(num_new)
    if not device or not beside:
        return None
    return device, beside

"""Requests that finish apart while the device step launches each step ahead (spec_step.launch_following): the
batch and the run that the CPU and GPU tests of the narrowed following step share."""

from __future__ import annotations

import random

from engine_driving import Outputs

from executor_service.engine.request import Status
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

MIXED = [
    SamplingSettings(),
    SamplingSettings(0.7, top_p=0.9, seed=11),
    SamplingSettings(0.7, top_k=20, seed=12),
    SamplingSettings(repetition_penalty=1.2),
    SamplingSettings(logprobs=3),
    SamplingSettings(0.8, seed=13, presence_penalty=0.5),
]


def finishing_prompts() -> dict[str, list[int]]:
    """MIXED's prompts: 3-40 tokens each, seeded."""
    rng = random.Random(9)
    return {f"r{i}": [rng.randrange(500) for _ in range(rng.randint(3, 40))] for i in range(len(MIXED))}


def logprobs(outputs: Outputs, rid: str) -> list:
    return [lp for o in outputs.by_id[rid] for lp in (o.logprobs or [])]


def serve_finishing_apart(session: ModelSession, narrow: bool) -> tuple[Outputs, int]:
    """MIXED's requests together, each finishing at its own step (their lengths), so most finishes land while a
    step launched ahead is in flight: the outputs, and how many device steps were launched from the host (not
    derived from the step before). `narrow` False: no step is launched after a finish, as before, so each finish
    makes the host launch the next step afresh (the control)."""
    spec_step = session.engine.spec_step
    assert spec_step is not None
    if not narrow:
        original = session.engine._launch_following

        def refuse_finished(requests, pending):  # type: ignore[no-untyped-def]
            if any(r.status is not Status.RUNNING for r in requests):
                return None
            return original(requests, pending)

        session.engine._launch_following = refuse_finished  # type: ignore[method-assign]
    fresh = spec_step.counts["eager"] + spec_step.counts["graph"]
    sink = Outputs()
    for index, (rid, prompt) in enumerate(finishing_prompts().items()):
        session.engine.add(session.new_request(rid, prompt, MIXED[index], 12 + 7 * index, sink))
    session.engine.run_until_idle()
    return sink, spec_step.counts["eager"] + spec_step.counts["graph"] - fresh

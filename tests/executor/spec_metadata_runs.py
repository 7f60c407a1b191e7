"""Speculative runs whose drafter records every proposal's metadata, with scripted wrong drafts, for the R10 checks
(fresh metadata for every draft pass) on the CPU and under CUDA graphs (imported as `spec_metadata_runs`: pytest
puts this folder on sys.path)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine_driving import Collector
from greedy_reference import greedy_reference
from spec_builders import ReplayDrafts

from executor_service.engine.request import Finish, Request
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

K = 4
VOCAB = 512
MAX_TOKENS = 20
BATCHED_TOKENS = 24  # longer prompts are prefilled in chunks, which feed the drafter but propose nothing

# Prompt lengths at and around the block size (16) and twice it, so chain steps and blocks cross blocks.
LENGTHS = {"all": 31, "some": 16, "own": 28, "w0": 32, "w1": 17, "w3": 5}

# Scripted drafts (the target's continuation, wrong at this index; None: all right) so verification accepts
# all, some or none of them; "own" keeps the drafter's own drafts (almost never accepted).
WRONG_AT: dict[str, int | None] = {"all": None, "some": 2, "w0": 0, "w1": 1, "w3": 3}


def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {rid: [rng.randrange(VOCAB) for _ in range(length)] for rid, length in LENGTHS.items()}


@dataclass(frozen=True)
class Proposal:
    request_id: str
    tokens: list[int]  # prompt and output when the drafts were made
    drafts: list[int]  # what the drafter proposed (before any scripted replacement)


class Recorder:
    """The proposer's replay hook: records every proposal, then hands the engine the scripted drafts."""

    def __init__(self, scripts: dict[str, ReplayDrafts]) -> None:
        self.scripts, self.proposals = scripts, []

    def __call__(self, request: Request, drafts: list[int]) -> list[int]:
        self.proposals.append(Proposal(request.request_id, request.prompt_ids + request.output_ids, list(drafts)))
        script = self.scripts.get(request.request_id)
        return script(request, drafts) if script is not None else drafts


def run_recorded(
    session: ModelSession, batch: dict[str, list[int]], wrong_at: dict[str, int | None], max_tokens: int
) -> tuple[list[Proposal], dict[str, Finish]]:
    """Greedy requests through the engine; every proposal made, and each request's finish. The tokens must
    be the target's own (whatever the drafts, greedy verification keeps them)."""
    assert session.proposer is not None
    expected = {rid: greedy_reference(session.loaded.model, prompt, max_tokens) for rid, prompt in batch.items()}
    recorder = Recorder({rid: ReplayDrafts(expected, VOCAB, wrong) for rid, wrong in wrong_at.items()})
    session.proposer.replay, sink = recorder, Collector()
    for rid, prompt in batch.items():
        session.engine.add(session.new_request(rid, prompt, SamplingSettings(), max_tokens, sink))
    session.engine.run_until_idle()
    finishes = {}
    for rid in batch:
        last = sink.outputs[rid][-1]
        assert last.error is None and last.finish is not None, (rid, last.error)
        assert sink.tokens(rid) == expected[rid], rid
        finishes[rid] = last.finish
    return recorder.proposals, finishes

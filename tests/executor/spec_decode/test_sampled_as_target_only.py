"""Seeded sampled requests emit the tokens of target-only decoding, token for token, whatever the drafter proposes
and whatever k each step takes (verifier.py: a draft hits when it is its row's own draw, keyed by its position):
chains (EAGLE-1, EAGLE-3, DFlash) on the device step and the host path, trees, drafts all right, partly right or
random, k switched mid-request by adaptive speculation, and requests with top-k / top-p / min-p, penalties and
logprobs beside greedy ones. So adaptive speculation changes no sampled token either."""

from __future__ import annotations

import pytest
from engine_driving import Collector
from executor_builders import tiny_session
from spec_builders import ReplayDrafts, Scripted, spec_session
from spec_checks import assert_no_leak, prompts
from tree_cases import tree_session

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from specdec.v1 import common_pb2

MAX_TOKENS = 24
SETTINGS = [
    SamplingSettings(0.8, seed=11, ignore_eos=True),
    SamplingSettings(1.0, top_k=20, seed=12, ignore_eos=True),
    SamplingSettings(0.7, top_p=0.9, min_p=0.02, seed=13, ignore_eos=True),
    SamplingSettings(0.9, repetition_penalty=1.3, presence_penalty=0.4, seed=14, ignore_eos=True),
    SamplingSettings(1.1, seed=15, logprobs=2, ignore_eos=True),
    SamplingSettings(ignore_eos=True),  # greedy beside them
]
BATCH = prompts(len(SETTINGS), seed=8, longest=12)


def generate(session: ModelSession) -> Collector:
    sink = Collector()
    for (rid, prompt), settings in zip(BATCH.items(), SETTINGS, strict=True):
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    assert all(o.error is None for outputs in sink.outputs.values() for o in outputs)
    return sink


@pytest.fixture(scope="module")
def target_only() -> dict[str, list[int]]:
    sink = generate(tiny_session(max_num_batched_tokens=128, max_num_seqs=16))
    return {rid: sink.tokens(rid) for rid in BATCH}


def assert_target_only(session: ModelSession, target_only: dict[str, list[int]]) -> Collector:
    sink = generate(session)
    for rid in BATCH:
        assert sink.tokens(rid) == target_only[rid], rid
    assert_no_leak(session)
    return sink


@pytest.mark.parametrize("path", ["device", "host"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_chains_as_k_switches(method: str, path: str, target_only: dict[str, list[int]]) -> None:
    """A random drafter (its drafts rejected) and k switched every step or two, none included."""
    k = 4
    session = spec_session(method, k, max_num_batched_tokens=128)
    if path == "host":
        session.engine.spec_step = None
    session.engine.speculation = Scripted([k, k, 0, 2, k, 0, 0, 1, 3, k], list(range(k + 1)))
    assert_target_only(session, target_only)


@pytest.mark.parametrize("wrong_at", [None, 1])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_drafts_that_know_the_target_are_accepted_and_change_nothing(
    method: str, wrong_at: int | None, target_only: dict[str, list[int]]
) -> None:
    """A drafter that proposes the target-only run's own tokens (the draft at `wrong_at` corrupted), k switched as
    above: every draft (or exactly `wrong_at` of them) is accepted, sampled requests' too, and the tokens stay the
    same. (A row's draw keyed by the root, not by its own position, fails here.)"""
    k = 4
    session = spec_session(method, k, max_num_batched_tokens=128)
    assert session.proposer is not None
    references = {rid: tokens + [0] * (k + 1) for rid, tokens in target_only.items()}
    session.proposer.replay = ReplayDrafts(references, 512, wrong_at)
    session.engine.speculation = Scripted([k, k, 0, 2, k, 0, 0, 1, 3, k], list(range(k + 1)))
    verified: list[tuple[int, int]] = []
    session.engine.on_verify = lambda drafts, accepted: verified.extend(zip(drafts, accepted, strict=True))
    assert_target_only(session, target_only)
    assert len([d for d, _ in verified if d == k]) > 10 and {d for d, _ in verified} >= {1, 2, k}
    assert all(a == (d if wrong_at is None else min(d, wrong_at)) for d, a in verified), verified


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_trees_as_k_switches(method: str, target_only: dict[str, list[int]]) -> None:
    tree = common_pb2.DraftTree(top_k=2, verify_budget=6)
    session = tree_session(method, tree, k=3, max_num_batched_tokens=128)
    size = session.proposer.num_draft_tokens  # type: ignore[union-attr]
    session.engine.speculation = Scripted([size, size, 0, size, 0, 0, size], [0, size])
    assert_target_only(session, target_only)

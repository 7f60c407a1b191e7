"""Greedy decoding with penalties, and logprobs, through the engine: target-only, EAGLE-3 and DFlash give the
penalised reference token for token (drafts accepted in full and in part), in batches mixed with plain greedy
requests, which keep their own reference; the logprobs of every emitted token, accepted drafts included, are
the target's log-softmax recomputed densely; a batch where one request asks for logprobs or penalties stays on
the device-resident step."""

from __future__ import annotations

import random

import pytest
from engine_driving import Collector
from executor_builders import greedy, tiny_session
from greedy_reference import greedy_reference
from penalty_cases import (
    BIASED,
    BIASED_PENALISED,
    MAX_TOKENS,
    PENALISED,
    PENALISED_WITH_LOGPROBS,
    WITH_LOGPROBS,
    check_logprobs,
)
from penalty_reference import greedy_penalised
from spec_builders import ReplayDrafts, spec_session

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

VOCAB = 512


def prompts(count: int, seed: int) -> dict[str, list[int]]:
    """Short prompts over a few ids, so that the penalties meet repeated tokens."""
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(12) for _ in range(rng.randint(3, 12))] for i in range(count)}


def run(session: ModelSession, batch: dict[str, tuple[list[int], SamplingSettings]]) -> Collector:
    sink = Collector()
    for rid, (prompt, settings) in batch.items():
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    assert session.kv_cache.allocator.num_used == 0
    return sink


def expected_tokens(session: ModelSession, prompt: list[int], settings: SamplingSettings) -> list[int]:
    model = session.loaded.model
    if settings.has_penalties:
        return greedy_penalised(model, prompt, MAX_TOKENS, settings)
    return greedy_reference(model, prompt, MAX_TOKENS)


@pytest.mark.parametrize(
    ("method", "wrong_at"), [(None, None), ("eagle3", None), ("eagle3", 1), ("dflash", None), ("dflash", 2)]
)
def test_penalised_greedy_is_the_same_with_every_drafter(method: str | None, wrong_at: int | None) -> None:
    """The drafts replay each request's reference (wrong at `wrong_at`): a verify row that did not count the
    accepted drafts before it would pick another token than the reference. With a drafter every verify step
    runs on the device step (the host path verifies no draft)."""
    session = tiny_session() if method is None else spec_session(method, 3, max_num_batched_tokens=64)
    session.engine.step_counts.clear()  # the warm-up's steps
    settings = [PENALISED, greedy(MAX_TOKENS), WITH_LOGPROBS, PENALISED_WITH_LOGPROBS, BIASED, BIASED_PENALISED]
    batch = {rid: (prompt, settings[i % 6]) for i, (rid, prompt) in enumerate(prompts(12, seed=3).items())}
    expected = {rid: expected_tokens(session, prompt, s) for rid, (prompt, s) in batch.items()}
    plain = {rid: greedy_reference(session.loaded.model, p, MAX_TOKENS) for rid, (p, s) in batch.items()}
    assert any(expected[rid] != plain[rid] for rid, (_, s) in batch.items() if s.has_penalties)  # penalties bite
    biased = [rid for rid, (_, s) in batch.items() if s.logit_bias]
    assert all(expected[rid] != plain[rid] and 7 not in expected[rid] for rid in biased[::2])  # BIASED bites
    if method is not None:
        session.proposer.replay = ReplayDrafts(expected, VOCAB, wrong_at)
    sink = run(session, batch)
    for rid, (prompt, request_settings) in batch.items():
        assert sink.tokens(rid) == expected[rid], rid
        if request_settings.logprobs is not None:
            check_logprobs(session, sink, rid, prompt, request_settings.logprobs)
        else:
            assert all(o.logprobs is None for o in sink.outputs[rid])
        finish = sink.outputs[rid][-1].finish
        assert finish is not None and (method is None or finish.accepted_tokens > 0)
    if method is not None:
        host = session.engine.step_counts
        assert session.engine.spec_step.counts["extras"] > 0 and host["host drafts"] == 0, host


@pytest.mark.parametrize("settings", [WITH_LOGPROBS, PENALISED, PENALISED_WITH_LOGPROBS])
def test_one_such_request_keeps_the_batch_on_the_device_step(settings: SamplingSettings) -> None:
    """A request asking for logprobs or setting penalties joins plain greedy ones on the device step (the extras
    variant): the host path verifies no draft (it runs the prefills alone), and each request gets its own answer,
    logprobs included."""
    session = spec_session("eagle3", 3, max_num_batched_tokens=64)
    assert session.engine.spec_step is not None
    counts = session.engine.spec_step.counts
    session.engine.step_counts.clear()  # the warm-up's steps
    mixed = {**{rid: (prompt, greedy(MAX_TOKENS)) for rid, prompt in prompts(3, seed=5).items()}}
    mixed["special"] = ([1, 1, 2, 1, 3], settings)
    sink = run(session, mixed)
    assert counts["extras"] > 0 and counts["eager following"] > 0
    host = session.engine.step_counts
    assert host["host"] > 0 and host["host drafts"] == 0, host  # the prefills alone
    for rid, (prompt, request_settings) in mixed.items():
        assert sink.tokens(rid) == expected_tokens(session, prompt, request_settings), rid
    if settings.logprobs is not None:
        check_logprobs(session, sink, "special", [1, 1, 2, 1, 3], settings.logprobs)

"""Speculative decoding on the CPU: greedy speculative output equals greedy target-only output token for
token for every drafter, k and batch size; acceptance really happens (replayed and partial); requests
join and leave; stats add up; nothing leaks."""

from __future__ import annotations

import pytest
from engine_driving import Collector, add_all
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import ReplayDrafts, spec_session
from spec_checks import VOCAB, assert_no_leak, prompts, scripted_verify_steps

from executor_service.server.session import ModelSession

ALL_METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def reference(session: ModelSession, batch: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    return {rid: greedy_reference(session.loaded.model, prompt, max_tokens) for rid, prompt in batch.items()}


@pytest.mark.parametrize("k", [1, 3, 7, 15])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_greedy_speculative_equals_target_only(method: str, k: int) -> None:
    session = spec_session(method, k, max_num_batched_tokens=48)
    batch, sink = prompts(5, seed=k), Collector()
    add_all(session, batch, greedy(12), sink)
    session.engine.run_until_idle()
    for rid, expected in reference(session, batch, 12).items():
        assert sink.tokens(rid) == expected, rid
        finish = sink.outputs[rid][-1].finish
        assert finish is not None and finish.reason == "length" and finish.verify_steps > 0
        assert finish.drafted_tokens == sum(o.num_drafted for o in sink.outputs[rid])
        assert finish.accepted_tokens == sum(o.num_accepted for o in sink.outputs[rid])
    assert_no_leak(session)


@pytest.mark.parametrize("batch_size", [1, 2, 16])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_batch_sizes(method: str, batch_size: int) -> None:
    session = spec_session(method, 3, max_num_batched_tokens=256, num_kv_blocks=160)
    batch, sink = prompts(batch_size, seed=batch_size, longest=20), Collector()
    add_all(session, batch, greedy(8), sink)
    session.engine.run_until_idle()
    for rid, expected in reference(session, batch, 8).items():
        assert sink.tokens(rid) == expected, rid
    assert_no_leak(session)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_requests_join_and_leave_mid_flight(method: str) -> None:
    """Requests of different lengths join while others verify, so steps mix prefill chunks, verification
    and proposals, and requests leave at different steps."""
    session = spec_session(method, 3, max_num_batched_tokens=32)
    first, later, sink = prompts(3, seed=11), prompts(3, seed=12), Collector()
    later = {f"late{rid}": p for rid, p in later.items()}
    lengths = {rid: 4 + 3 * i for i, rid in enumerate([*first, *later])}
    for rid, prompt in first.items():
        session.engine.add(session.new_request(rid, prompt, greedy(lengths[rid]), lengths[rid], sink))
    for _ in range(3):
        session.engine.step()
    for rid, prompt in later.items():
        session.engine.add(session.new_request(rid, prompt, greedy(lengths[rid]), lengths[rid], sink))
    session.engine.run_until_idle()
    for rid, prompt in {**first, **later}.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, lengths[rid]), rid
    assert_no_leak(session)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_replayed_drafts_accept_as_scripted(method: str, wrong_at: int | None) -> None:
    """A drafter replaying the target's continuation is accepted in full (k + 1 tokens per verify step);
    corrupting draft `wrong_at` accepts exactly that many. The step count follows."""
    k, max_tokens = 4, 21
    session = spec_session(method, k)
    batch, sink = prompts(2, seed=3), Collector()
    expected = reference(session, batch, max_tokens)
    assert session.proposer is not None
    session.proposer.replay = ReplayDrafts(expected, VOCAB, wrong_at)
    add_all(session, batch, greedy(max_tokens), sink)
    session.engine.run_until_idle()
    for rid in batch:
        assert sink.tokens(rid) == expected[rid]
        finish = sink.outputs[rid][-1].finish
        assert finish is not None
        assert finish.verify_steps == scripted_verify_steps(max_tokens, k, wrong_at)
        if wrong_at is None:
            assert all(rate == 1.0 for rate in finish.acceptance_per_position)
        else:
            rates = finish.acceptance_per_position
            assert all(r == 1.0 for r in rates[:wrong_at]) and all(r == 0.0 for r in rates[wrong_at:])
    assert_no_leak(session)


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_small_vocabulary_gives_partial_acceptance(method: str) -> None:
    """With 4 tokens a random drafter is right sometimes but not always: both paths of verification run."""
    session = spec_session(method, 3, vocab_size=4, draft_seed=3)  # accepts 54 / 176 and 57 / 166
    batch, sink = prompts(4, seed=5, vocab=3), Collector()
    add_all(session, batch, greedy(30), sink)
    session.engine.run_until_idle()
    drafted = accepted = 0
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 30), rid
        finish = sink.outputs[rid][-1].finish
        assert finish is not None
        drafted, accepted = drafted + finish.drafted_tokens, accepted + finish.accepted_tokens
    assert 0 < accepted < drafted
    assert_no_leak(session)


def test_stop_token_inside_accepted_drafts_ends_there() -> None:
    """A stop id among the accepted drafts ends the request at that token; what follows is dropped."""
    k = 4
    session = spec_session("eagle", k)
    prompt = [5, 6, 7]
    expected = greedy_reference(session.loaded.model, prompt, 12)
    stop = expected[3]  # emitted inside the first verify step (tokens 1..5)
    assert session.proposer is not None
    session.proposer.replay = ReplayDrafts({"s": expected}, VOCAB)
    sink = Collector()
    settings = greedy(12, stop_token_ids=frozenset({stop}))
    session.engine.add(session.new_request("s", prompt, settings, 12, sink))
    session.engine.run_until_idle()
    assert sink.tokens("s") == expected[: expected.index(stop) + 1]
    assert sink.finish_reason("s") == "stop"
    finish = sink.outputs["s"][-1].finish
    assert finish is not None and finish.accepted_tokens == sum(o.num_accepted for o in sink.outputs["s"]) == k
    assert_no_leak(session)

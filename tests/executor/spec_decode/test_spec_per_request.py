"""Per-request speculation (GenerateRequest.num_speculative_tokens) at the engine level: requests drafting
different numbers of tokens, and plain ones (0), share steps; greedy output equals target-only for every one;
each verifies only its own drafts (the finished statistics say so); a plain request never runs the drafter;
admission and the scheduler count each request's own lookahead; all-at-k batches keep the device step."""

from __future__ import annotations

import random

import pytest
from engine_driving import Outputs, run_bounded
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import ReplayDrafts, spec_session
from spec_checks import VOCAB, assert_no_leak, generate_request, scripted_verify_steps

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from executor_service.server.validation import check_generate
from executor_service.spec_decode.proposer import ProposeBatch
from specdec_runtime.errors import InvalidArgument

K = 4
OWN_K = {"unset": None, "plain": 0, "one": 1, "two": 2, "three": 3, "all": K}
METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {rid: [rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for rid in OWN_K}


def add(session: ModelSession, rid: str, prompt: list[int], settings: SamplingSettings, sink: Outputs) -> None:
    max_tokens = settings.max_tokens or 12
    session.engine.add(session.new_request(rid, prompt, settings, max_tokens, sink, OWN_K.get(rid)))


def own_k(rid: str) -> int:
    k = OWN_K[rid]
    return K if k is None else k


def record_proposals(session: ModelSession) -> list[list[str]]:
    """The request ids of every batch the drafter ran on (host path)."""
    assert session.proposer is not None
    seen: list[list[str]] = []
    propose = session.proposer.propose

    def recording(batch: ProposeBatch) -> None:
        seen.append([e.request.request_id for e in batch.entries])
        propose(batch)

    session.proposer.propose = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("method", METHODS)
def test_mixed_k_batch_equals_target_only(method: str) -> None:
    """Every mix in one batch (unset, 0, 1, 2, 3, k) and a sampled request among them: greedy outputs equal
    the target's own; no chunk verifies more drafts than its request's k; a plain request never drafts and
    the drafter never runs over it."""
    session = spec_session(method, K, max_num_batched_tokens=64)
    batch, sink = prompts(seed=len(method)), Outputs()
    proposals = record_proposals(session)
    for rid, prompt in batch.items():
        add(session, rid, prompt, greedy(12), sink)
    sampled = SamplingSettings(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    session.engine.add(session.new_request("sampled", [7, 8, 9], sampled, 12, sink, 2))
    run_bounded(session.engine)
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 12), rid
        outputs = sink.by_id[rid]
        finish = outputs[-1].finish
        assert finish is not None and finish.reason == "length"
        assert all(o.num_drafted <= own_k(rid) for o in outputs), rid
        assert finish.drafted_tokens == sum(o.num_drafted for o in outputs)
        assert len(finish.acceptance_per_position) == own_k(rid), rid
    plain = sink.by_id["plain"][-1].finish
    assert plain is not None and plain.drafted_tokens == plain.verify_steps == 0
    assert not any("plain" in ids for ids in proposals) and proposals
    assert len(sink.tokens("sampled")) == 12 and all(o.num_drafted <= 2 for o in sink.by_id["sampled"])
    assert_no_leak(session)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_each_request_accepts_its_own_drafts(method: str) -> None:
    """A drafter replaying the target's continuation: every request accepts all of its own k drafts per step,
    no more, so its verify steps and per-position acceptance follow its own k."""
    max_tokens = 17
    session = spec_session(method, K)
    batch, sink = prompts(seed=5), Outputs()
    # Past max_tokens too: drafts beyond it are verified (and dropped), and right as well.
    expected = {rid: greedy_reference(session.loaded.model, p, max_tokens + K) for rid, p in batch.items()}
    assert session.proposer is not None
    session.proposer.replay = ReplayDrafts(expected, VOCAB)
    for rid, prompt in batch.items():
        add(session, rid, prompt, greedy(max_tokens), sink)
    run_bounded(session.engine)
    for rid in batch:
        assert sink.tokens(rid) == expected[rid][:max_tokens], rid
        finish = sink.by_id[rid][-1].finish
        assert finish is not None
        k = own_k(rid)
        assert finish.verify_steps == (scripted_verify_steps(max_tokens, k, None) if k else 0), rid
        assert finish.acceptance_per_position == (1.0,) * k, rid
        assert finish.accepted_tokens == finish.drafted_tokens, rid
    assert_no_leak(session)


def test_only_plain_requests_never_run_the_drafter() -> None:
    session = spec_session("eagle3", K)
    assert session.proposer is not None
    before = dict(session.proposer.pass_counts)
    batch, sink = prompts(seed=9), Outputs()
    for rid, prompt in batch.items():
        session.engine.add(session.new_request(rid, prompt, greedy(8), 8, sink, 0))
    run_bounded(session.engine)
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 8), rid
    assert dict(session.proposer.pass_counts) == before
    assert_no_leak(session)


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_all_at_the_loaded_k_keeps_the_device_step(method: str) -> None:
    """Requests asking for the loaded k explicitly are the common case: verify + propose on the device."""
    session = spec_session(method, K)
    assert session.engine.spec_step is not None
    batch, sink = prompts(seed=2), Outputs()
    for rid, prompt in batch.items():
        session.engine.add(session.new_request(rid, prompt, greedy(12), 12, sink, K))
    run_bounded(session.engine)
    assert sum(session.engine.spec_step.counts.values()) > 0
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 12), rid


BLOCKS, BLOCK_SIZE = 8, 16
CAPACITY = BLOCKS * BLOCK_SIZE


@pytest.mark.parametrize(("method", "k"), [("eagle", 1), ("eagle", 0), ("eagle3", 3), ("dflash", 2), ("dflash", 0)])
def test_admission_and_the_cache_count_the_requests_own_k(method: str, k: int) -> None:
    """A request drafting fewer tokens holds less headroom: admission lets it generate more, and the engine
    runs the largest such request to the end alone in the cache (reserving the loaded k's lookahead, it
    could never grow and would fail)."""
    session = spec_session(method, 6, num_kv_blocks=BLOCKS)
    prompt = [random.Random(k).randrange(VOCAB - 1) for _ in range(90)]
    loaded_most = check_generate(generate_request(prompt, None, None), session.limits, None)[2]
    most = check_generate(generate_request(prompt, None, k), session.limits, None)[2]
    lookahead = 0 if k == 0 else (6 + 1 if method == "dflash" else k + 1)  # DFlash's block is k + 1 = 7
    headroom = k + lookahead - 1 if lookahead else 0
    assert most == CAPACITY - headroom - len(prompt) > loaded_most
    with pytest.raises(Exception, match="can never fit"):
        check_generate(generate_request(prompt, most + 1, k), session.limits, None)
    outputs = Outputs()
    session.engine.add(session.new_request("largest", prompt, greedy(most), most, outputs, k))
    run_bounded(session.engine)
    assert outputs.error("largest") is None
    assert outputs.tokens("largest") == greedy_reference(session.loaded.model, prompt, most)
    assert session.kv_cache.allocator.num_used == 0


def test_out_of_range_values_name_the_field() -> None:
    session = spec_session("dflash", 3)
    for bad in (-1, 4, 1 << 30):
        with pytest.raises(InvalidArgument) as err:
            check_generate(generate_request([1, 2, 3], 4, bad), session.limits, None)
        assert [v.field for v in err.value.field_violations] == ["num_speculative_tokens"]
        assert "[0, 3]" in err.value.field_violations[0].description
    for good in (0, 3, None):
        assert check_generate(generate_request([1, 2, 3], 4, good), session.limits, None)[2] == 4

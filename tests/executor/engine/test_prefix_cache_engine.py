"""Prefix caching never changes outputs: the same requests with it on and off give the same tokens and, with
a drafter, the same drafts (so the drafter's cached K/V is right too, which greedy outputs alone would not
show); with EAGLE-3 and DFlash, shared prefixes of 1-3 blocks, prompts of whole blocks, preemption in a small
cache and aborts. Wrong keys (no parent, EAGLE's next token left out) are caught by these comparisons."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from engine_driving import Outputs, run_bounded
from executor_builders import greedy, load_request
from spec_builders import Scripted, draft_model, rule_out

import executor_service.engine.prefix_cache as prefix_cache_module
from executor_service.engine.engine import Engine
from executor_service.engine.request import Request, Status
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.wire import resolve_target
from executor_service.spec_decode.deferred_context import DeferredContext
from specdec.v1 import common_pb2

BLOCK = 16
MAX_TOKENS = 8
Phases = list[dict[str, list[int]]]  # requests added together; each phase runs to the end before the next


def session(
    method: str | None, caching: bool, num_kv_blocks: int = 64, k: int = 3, backend: str = "CPU_ATTN"
) -> ModelSession:
    request = load_request(num_kv_blocks=num_kv_blocks, block_size=BLOCK)
    request.enable_prefix_caching = caching
    if method is not None:
        request.draft.CopyFrom(draft_model(method, k))
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None) if method is not None else None
    decision = common_pb2.BackendDecision(backend=backend)
    return build_session(
        source, request, decision, torch.device("cpu"), EngineSettings(64, 8), start=False, draft=draft,
        draft_decision=decision if method is not None else None,
    )  # fmt: skip


class Run:
    """One workload on one session: every request's tokens, its drafts by the state they were proposed in
    (tokens, computed tokens: scheduling may differ between runs, e.g. where a prefill chunk ends or a
    preemption strikes, but drafts from one state must not), and the request itself."""

    def __init__(self, built: ModelSession) -> None:
        self.session, self.outputs = built, Outputs()
        self.drafts: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(dict)
        self.requests: dict[str, Request] = {}
        if built.proposer is not None:
            built.proposer.replay = self._record

    def _record(self, request: Request, drafts: list[int]) -> list[int]:
        self.drafts[request.request_id][(request.num_tokens, request.num_computed_tokens)] = list(drafts)
        return drafts

    def add(self, batch: dict[str, list[int]]) -> None:
        for rid, prompt in batch.items():
            request = self.session.new_request(rid, prompt, greedy(MAX_TOKENS), MAX_TOKENS, self.outputs)
            self.requests[rid] = request
            self.session.engine.add(request)

    def phases(self, phases: Phases) -> Run:
        for batch in phases:
            self.add(batch)
            run_bounded(self.session.engine)
        return self

    def cached(self, rid: str) -> int:
        finish = self.outputs.by_id[rid][-1].finish
        assert finish is not None, rid
        return finish.cached_prompt_tokens


def assert_same(on: Run, off: Run) -> None:
    for rid in off.requests:
        assert on.outputs.tokens(rid) == off.outputs.tokens(rid), rid
        assert len(on.outputs.tokens(rid)) == MAX_TOKENS, rid
        assert same_drafts(on.drafts[rid], off.drafts[rid]), rid
    for run in (on, off):
        pool = run.session.kv_cache.allocator
        assert pool.num_used == 0 and not any(pool.ref_counts) and run.session.engine.num_live == 0


def same_drafts(on: dict[tuple[int, int], list[int]], off: dict[tuple[int, int], list[int]]) -> bool:
    """Equal drafts from every state both runs proposed in, and most states in common (no drafter: none)."""
    common = on.keys() & off.keys()
    assert len(common) >= min(len(on), len(off)) - 2, (sorted(on), sorted(off))
    return all(on[state] == off[state] for state in common)


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(count)]


def shared_prefix_phases(seed: int = 0) -> Phases:
    rng = random.Random(seed)
    system = tokens(rng, 3 * BLOCK)
    return [
        {"seed": system + tokens(rng, 5)},
        {
            "one-block": system[: BLOCK + 1] + tokens(rng, 7),
            "two-blocks-and-two": system[: 2 * BLOCK + 1] + tokens(rng, 1),
            "two-blocks-exactly": system[: 2 * BLOCK],
            "three-blocks-exactly": list(system),
            "same-again": system + tokens(random.Random(seed), 3 * BLOCK + 5)[3 * BLOCK :],
            "other-token-after-block": [*system[:BLOCK], system[BLOCK] % 499 + 1, *system[BLOCK + 1 :]],
            "unrelated": tokens(rng, 21),
        },
        {
            "twin-a": system[: BLOCK + 1] + tokens(random.Random(7), 20),
            "twin-b": system[: BLOCK + 1] + tokens(random.Random(7), 20),
        },
    ]


@pytest.mark.parametrize("method", [None, "eagle3", "dflash"])
def test_shared_prefixes_give_the_same_tokens_and_drafts(method: str | None) -> None:
    phases = shared_prefix_phases()
    on, off = Run(session(method, True)).phases(phases), Run(session(method, False)).phases(phases)
    assert_same(on, off)
    assert on.session.info.prefix_caching and not off.session.info.prefix_caching
    after = 1 if method == "eagle3" else 0  # EAGLE's keys hold the first token of the next block
    assert on.cached("seed") == 0 and on.cached("unrelated") == 0
    assert on.cached("one-block") == on.cached("two-blocks-exactly") == BLOCK
    assert on.cached("two-blocks-and-two") == on.cached("three-blocks-exactly") == 2 * BLOCK
    assert on.cached("same-again") == 3 * BLOCK
    assert on.cached("other-token-after-block") == (0 if after else BLOCK)
    assert on.cached("twin-b") == BLOCK  # the twins ran together: block 0 shared, the rest computed by both
    assert all(off.cached(rid) == 0 for rid in off.requests)
    stats = on.session.prefix_cache_stats()
    assert stats.hits == sum(on.cached(rid) for rid in on.requests)
    assert stats.queries == sum(len(r.prompt_ids) for r in on.requests.values())
    assert stats.cached_free_blocks > 0 and off.session.prefix_cache_stats().queries == 0


def test_flex_attention_reads_shared_blocks() -> None:
    """FLEX_ATTENTION (a GPU backend, eager here) maps each request's physical blocks to logical ones in its
    BlockMask: requests of one step holding the same physical blocks must each read them as their own."""
    phases = shared_prefix_phases()
    on = Run(session("eagle3", True, backend="FLEX_ATTENTION")).phases(phases)
    assert_same(on, Run(session("eagle3", False)).phases(phases))
    assert on.cached("twin-b") == BLOCK and on.cached("same-again") == 3 * BLOCK


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_preemption_in_a_small_cache(method: str) -> None:
    rng = random.Random(3)
    system = tokens(rng, 2 * BLOCK + 1)
    phases = [{"seed": system + tokens(rng, 3)}, {f"p{i}": system + tokens(rng, 4 + 5 * i) for i in range(6)}]
    on, off = Run(session(method, True, num_kv_blocks=9)).phases(phases), Run(session(method, False, 9)).phases(phases)
    assert_same(on, off)
    assert sum(r.num_preemptions for r in on.requests.values()) > 0
    assert all(on.cached(f"p{i}") == 2 * BLOCK for i in range(6))


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_aborts_free_shared_blocks_once(method: str) -> None:
    rng = random.Random(4)
    system = tokens(rng, 2 * BLOCK + 3)
    batch = {f"a{i}": system + tokens(rng, 6 + i) for i in range(4)}
    runs = []
    for caching in (True, False):
        run = Run(session(method, caching)).phases([{"seed": [*system, 7]}])
        run.add(batch)
        engine = run.session.engine
        engine._drain_commands()
        for _ in range(3):  # with the cache: admitted with their prefill, then two speculative steps
            engine.step()
        assert engine.abort(["a1", "a3"]) == ["a1", "a3"]
        run_bounded(engine)
        runs.append(run.phases([{"after": [*system, 9, 9]}]))  # the prefix is still cached after the aborts
    on, off = runs
    for rid in ("a1", "a3"):
        assert on.outputs.finish_reason(rid) == "abort"
        del on.requests[rid], off.requests[rid]
    assert_same(on, off)
    assert on.cached("a0") == on.cached("after") == 2 * BLOCK


def test_a_key_without_its_parent_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that opens with another prompt's second block: only the chained key tells them apart."""
    rng = random.Random(5)
    first, second = tokens(rng, BLOCK), tokens(rng, BLOCK)
    phases = [{"x": first + second + tokens(rng, 4)}, {"y": second + tokens(rng, 6)}]
    off = Run(session(None, False)).phases(phases)
    assert_same(Run(session(None, True)).phases(phases), off)
    real = prefix_cache_module.hash_block_tokens
    monkeypatch.setattr(prefix_cache_module, "hash_block_tokens", lambda parent, ids: real(None, ids))
    wrong = Run(session(None, True)).phases(phases)
    assert wrong.cached("y") == BLOCK
    assert wrong.outputs.tokens("y") != off.outputs.tokens("y")


def test_eagle_keys_without_the_next_token_would_be_caught() -> None:
    """Same first block, another token after it: EAGLE's drafter K/V of the block's last position differs."""
    rng = random.Random(6)
    block, tail = tokens(rng, BLOCK), tokens(rng, 20)
    phases = [{"x": [*block, 11, *tail]}, {"y": [*block, 12, *tail]}]
    off = Run(session("eagle3", False)).phases(phases)
    assert_same(Run(session("eagle3", True)).phases(phases), off)
    wrong = Run(session("eagle3", True))
    assert wrong.session.engine.scheduler.prefix_cache is not None
    wrong.session.engine.scheduler.prefix_cache.tokens_after = 0
    wrong.phases(phases)
    assert wrong.cached("y") == BLOCK
    assert wrong.outputs.tokens("y") == off.outputs.tokens("y")  # greedy outputs cannot tell ...
    assert not same_drafts(wrong.drafts["y"], off.drafts["y"])  # ... the drafts do


def test_requests_the_drafter_skips_register_nothing() -> None:
    """A request that never drafts (num_speculative_tokens 0) skips the drafter, so its blocks hold the target's
    K/V only: it takes cached blocks but registers none, and a drafting request computes them itself."""
    prompt = tokens(random.Random(8), 2 * BLOCK + 5)
    run = Run(session("eagle3", True))

    def plain(rid: str) -> None:
        made = run.session.new_request(rid, prompt, greedy(MAX_TOKENS), MAX_TOKENS, run.outputs, num_draft_tokens=0)
        run.requests[rid] = made
        run.session.engine.add(made)
        run_bounded(run.session.engine)

    plain("plain")
    run.phases([{"drafting": prompt}])
    plain("plain-again")
    assert (run.cached("plain"), run.cached("drafting"), run.cached("plain-again")) == (0, 0, 2 * BLOCK)
    assert run.outputs.tokens("plain") == run.outputs.tokens("drafting") == run.outputs.tokens("plain-again")


def seed_and_later(rng_seed: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """A seed request's prompt (3 blocks of system prompt and 5 tokens) and a later one extending it by 3."""
    rng = random.Random(rng_seed)
    seed = {"seed": tokens(rng, 3 * BLOCK) + tokens(rng, 5)}
    return seed, {"later": seed["seed"] + tokens(rng, 3)}


def held_context_runs(method: str, seed_cycle: list[int]) -> tuple[Run, Run]:
    """A seed request at k = `seed_cycle` whose drafter context is held up to 64 rows (its whole life at k = 0:
    deferred_context.py), then a request sharing its 3 blocks, drafting every step; cache on, then off."""
    seed, later = seed_and_later(9)
    runs = []
    for caching in (True, False):
        run = Run(session(method, caching))
        engine = run.session.engine
        engine.deferred = DeferredContext(engine.scheduler.max_num_seqs, limit=64)
        engine.speculation = Scripted(seed_cycle, [0, 3])
        run.phases([seed])
        engine.speculation = Scripted([3], [0, 3])
        runs.append(run.phases([later]))
    return runs[0], runs[1]


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_blocks_whose_drafter_context_is_held_are_registered_after_it_runs(method: str) -> None:
    """A request at k = 0 throughout holds its drafter context to the end: its blocks never have the drafter's
    K/V, so none is registered and the later request computes them; once a flush ran (drafting resumed), they are
    registered and shared. The drafts are the cache-off run's either way."""
    on, off = held_context_runs(method, [0])
    assert_same(on, off)
    assert on.cached("later") == 0
    on, off = held_context_runs(method, [0, 0, 3])
    assert_same(on, off)
    assert on.cached("later") == 3 * BLOCK


def test_registering_held_blocks_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: blocks registered up to the computed tokens while their drafter context is held hand the
    later request blocks without the drafter's K/V: its drafts differ from the cache-off run's."""
    monkeypatch.setattr(DeferredContext, "written", lambda self, request: request.num_computed_tokens)
    on, off = held_context_runs("eagle3", [0])
    assert on.cached("later") == 3 * BLOCK
    assert on.outputs.tokens("later") == off.outputs.tokens("later")  # greedy outputs cannot tell ...
    assert not same_drafts(on.drafts["later"], off.drafts["later"])  # ... the drafts do


def released_seed_runs(after_prompt: bool) -> tuple[Run, Run]:
    """A seed request released from the drafter (drafter_release.py): from its admission (drafting already ruled
    out), or after the drafter's pass over its prompt; then a request sharing its 3 blocks, followed and drafting
    every step. Cache on, then off."""
    seed, later = seed_and_later(10)
    runs = []
    for caching in (True, False):
        run = Run(session("eagle3", caching))
        engine = run.session.engine
        engine.speculation = Scripted([3], [0, 3], releases=True)
        if not after_prompt:
            rule_out(engine.speculation)
        run.add(seed)
        engine._drain_commands()
        engine.step()  # the prompt, then drafts (after_prompt: the drafter's K/V of the prompt written)
        rule_out(engine.speculation)
        run_bounded(engine)
        assert engine.release is not None and engine.release.counts["released"] == 1
        engine.speculation = Scripted([3], [0, 3])
        runs.append(run.phases([later]))
    return runs[0], runs[1]


@pytest.mark.parametrize("after_prompt", [False, True], ids=["from-admission", "after-its-prompt"])
def test_a_released_request_registers_only_blocks_with_the_drafters_kv(after_prompt: bool) -> None:
    """Released from its admission, the seed's blocks never get the drafter's K/V: none is registered and the later
    request computes them; released after its prompt's pass, the blocks it registered then are shared. The later
    request's drafts are the cache-off run's either way."""
    on, off = released_seed_runs(after_prompt)
    assert_same(on, off)
    assert on.cached("later") == (3 * BLOCK if after_prompt else 0)


def test_registering_a_released_requests_blocks_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a released request registering its blocks hands the later request blocks without the
    drafter's K/V: its drafts differ from the cache-off run's."""

    def registering_all(self: Engine, requests: list[Request]) -> None:
        prefix_cache = self.scheduler.prefix_cache
        for request in requests:
            if prefix_cache is not None and request.status is Status.RUNNING:
                prefix_cache.cache_blocks(request, None)

    monkeypatch.setattr(Engine, "_cache_prefixes", registering_all)
    on, off = released_seed_runs(after_prompt=False)
    assert on.cached("later") == 3 * BLOCK
    assert on.outputs.tokens("later") == off.outputs.tokens("later")  # greedy outputs cannot tell ...
    assert not same_drafts(on.drafts["later"], off.drafts["later"])  # ... the drafts do

"""The engine against the full-recompute reference: continuous batching, chunked prefill, joining
mid-flight, preemption, every CPU backend, sampling controls, and blocks returned on every exit."""

from __future__ import annotations

import queue
import random

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import greedy, tiny_session
from greedy_reference import dense_logits, greedy_reference

from executor_service.engine.request import RequestOutput
from executor_service.engine.scheduler import ScheduledStep
from executor_service.sample.sampling import SamplingSettings
from kernels import unavailable_reason

VOCAB = 512


def prompts(count: int, seed: int, longest: int = 90) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))] for i in range(count)}


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_mixed_lengths_with_chunked_prefill_match_reference(architecture: str) -> None:
    session = tiny_session(architecture=architecture, max_num_batched_tokens=40)
    batch, sink = prompts(6, seed=1), Collector()
    add_all(session, batch, greedy(10), sink)
    session.engine.run_until_idle()
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 10), rid
        assert sink.finish_reason(rid) == "length"
    assert session.kv_cache.allocator.num_free == session.kv_cache.num_blocks


def test_requests_joining_mid_flight_match_reference() -> None:
    session = tiny_session(max_num_batched_tokens=32)
    first, later, sink = prompts(3, seed=2), prompts(3, seed=3), Collector()
    later = {f"late-{k}": v for k, v in later.items()}
    add_all(session, first, greedy(12), sink)
    for _ in range(5):  # some prefills done, some mid-way, some decoding
        session.engine._drain_commands()
        session.engine.step()
    add_all(session, later, greedy(12), sink)
    session.engine.run_until_idle()
    for rid, prompt in {**first, **later}.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 12), rid


def test_preemption_by_recompute_keeps_tokens_and_frees_blocks() -> None:
    session = tiny_session(num_kv_blocks=12, max_num_batched_tokens=64)  # 192 slots for 4 x ~60 tokens
    batch = {f"r{i}": [(7 * i + j) % VOCAB for j in range(30 + i)] for i in range(4)}
    sink = Collector()
    add_all(session, batch, greedy(24), sink)
    preempted: list[str] = []
    schedule = session.engine.scheduler.schedule

    def recording_schedule() -> ScheduledStep:  # observe preemptions without changing behaviour
        step = schedule()
        preempted.extend(r.request_id for r in step.preempted)
        return step

    session.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    session.engine.run_until_idle()
    assert preempted, "the cache was sized to force preemption"
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 24), rid
    assert session.kv_cache.allocator.num_free == 12


CPU_BACKENDS = ["CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN", "ROCM_ATTN"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_cpu_backend_gives_the_reference_tokens(backend: str) -> None:
    reason = unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:  # Triton kernels run on a CPU only where the interpreter is on (no GPU)
        pytest.skip(reason)
    session = tiny_session(backend=backend, max_num_batched_tokens=24)
    batch, sink = prompts(3, seed=4, longest=40), Collector()
    add_all(session, batch, greedy(5), sink)
    session.engine.run_until_idle()
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 5), (backend, rid)


def test_stop_tokens_eos_and_ignore_eos() -> None:
    session = tiny_session()
    prompt = prompts(1, seed=5)["r0"]
    expected = greedy_reference(session.loaded.model, prompt, 10)
    stop = expected[3]
    first_stop = expected.index(stop)
    sink = Collector()
    add_all(session, {"stop": prompt}, greedy(10, stop_token_ids=frozenset({stop})), sink)
    session.engine.run_until_idle()
    assert sink.tokens("stop") == expected[: first_stop + 1] and sink.finish_reason("stop") == "stop"

    request = session.new_request("eos", prompt, greedy(10), 10, sink)
    request.eos_token_ids = frozenset({stop})
    session.engine.add(request)
    ignoring = session.new_request("ignore", prompt, greedy(10, ignore_eos=True), 10, sink)
    ignoring.eos_token_ids = frozenset({stop})
    session.engine.add(ignoring)
    session.engine.run_until_idle()
    assert sink.tokens("eos") == expected[: first_stop + 1] and sink.finish_reason("eos") == "stop"
    assert sink.tokens("ignore") == expected and sink.finish_reason("ignore") == "length"


def test_seeded_sampling_replays_whatever_else_is_batched() -> None:
    session = tiny_session()
    prompt = prompts(1, seed=6)["r0"]
    settings = SamplingSettings(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone, crowd = Collector(), Collector()
    add_all(session, {"s": prompt}, SamplingSettings(**{**settings.__dict__, "max_tokens": 12}), alone)
    session.engine.run_until_idle()
    add_all(
        session, {"s": prompt, **prompts(4, seed=7)}, SamplingSettings(**{**settings.__dict__, "max_tokens": 12}), crowd
    )
    session.engine.run_until_idle()
    assert alone.tokens("s") == crowd.tokens("s")
    assert alone.tokens("s") != greedy_reference(session.loaded.model, prompt, 12)  # it did sample


def test_top_k_one_is_greedy() -> None:
    session = tiny_session()
    prompt, sink = prompts(1, seed=8)["r0"], Collector()
    add_all(session, {"k1": prompt}, SamplingSettings(temperature=1.5, top_k=1, max_tokens=8), sink)
    session.engine.run_until_idle()
    assert sink.tokens("k1") == greedy_reference(session.loaded.model, prompt, 8)


def test_abort_frees_blocks_on_the_engine_thread() -> None:
    session = tiny_session()
    results: queue.Queue[RequestOutput] = queue.Queue()
    session.engine.start()
    try:
        prompt = prompts(1, seed=9)["r0"]
        session.engine.add(session.new_request("long", prompt, greedy(), 400, results.put))
        first = results.get(timeout=30)
        assert first.token_ids and first.finish is None
        assert session.engine.abort(["long", "unknown"]) == ["long"]
        while (output := results.get(timeout=30)).finish is None:
            pass
        assert output.finish.reason == "abort"
        assert session.kv_cache.allocator.num_free == session.kv_cache.num_blocks
        assert session.engine.abort(["long"]) == []  # finished: nothing left to abort
    finally:
        session.shutdown()


def test_a_failing_step_fails_its_requests_frees_blocks_and_the_engine_goes_on() -> None:
    session = tiny_session()
    sink = Collector()
    original = session.engine.runner.execute
    calls = {"n": 0}

    def broken_once(inputs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return original(inputs)

    session.engine.runner.execute = broken_once  # type: ignore[method-assign]
    add_all(session, prompts(2, seed=10), greedy(6), sink)
    session.engine.run_until_idle()
    for rid in ("r0", "r1"):
        assert isinstance(sink.outputs[rid][-1].error, RuntimeError)
    assert session.kv_cache.allocator.num_free == session.kv_cache.num_blocks
    add_all(session, {"after": [1, 2, 3]}, greedy(4), sink)
    session.engine.run_until_idle()
    assert sink.tokens("after") == greedy_reference(session.loaded.model, [1, 2, 3], 4)


def test_shutdown_aborts_live_requests() -> None:
    session = tiny_session()
    results: queue.Queue[RequestOutput] = queue.Queue()
    session.engine.start()
    session.engine.add(session.new_request("x", [1, 2, 3], greedy(), 400, results.put))
    results.get(timeout=30)
    session.shutdown()
    outputs = []
    while not results.empty():
        outputs.append(results.get_nowait())
    assert outputs and outputs[-1].finish is not None and outputs[-1].finish.reason == "abort"
    assert session.kv_cache.allocator.num_free == session.kv_cache.num_blocks


def test_dense_reference_is_the_model() -> None:
    """The reference itself agrees with the paged model on a prefill (so agreement above means something)."""
    session = tiny_session()
    sink = Collector()
    add_all(session, {"p": list(range(40))}, greedy(1), sink)
    session.engine.run_until_idle()
    assert sink.tokens("p") == [int(dense_logits(session.loaded.model, list(range(40)))[-1].argmax())]

"""The overlapped decode step (engine/overlap_decode.py) against the serial one, on fresh sessions of the tiny
target: the same outputs (tokens, chunks, finishes) with requests of different lengths, stops at different
steps, an abort and an arrival mid-run, prefix caching, preemption in a tiny cache, the context's end, seeded
sampling and logits that are not finite; requests with penalties or logprobs keep the serial path. Every
overlapped run also asserts that its steady stretches did overlap (no comparison passes vacuously), and every
serial run that nothing did."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from engine_driving import Collector
from executor_builders import greedy, tiny_session
from greedy_reference import greedy_reference

from executor_service.engine.request import Request, RequestOutput
from executor_service.engine.scheduler import ScheduledStep
from executor_service.models.model import DecoderModel
from executor_service.runner.model_runner import StepInputs, StepOutput
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

VOCAB = 512
OVERLAPPED, ON_DEVICE = "overlapped decode", "decode on device"


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    settings: SamplingSettings
    max_tokens: int
    eos: frozenset[int] | None = None  # None: the model's


Jobs = dict[str, Job]
Event = Callable[[ModelSession, Collector], None]  # run before an engine step (by its index)


def random_prompts(count: int, seed: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, longest))] for _ in range(count)]


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return tiny_session().loaded.model


def add(session: ModelSession, sink: Collector, request_id: str, job: Job) -> None:
    request = session.new_request(request_id, job.prompt, job.settings, job.max_tokens, sink)
    if job.eos is not None:
        request.eos_token_ids = job.eos
    session.engine.add(request)


def generate(
    session: ModelSession, jobs: Jobs, events: dict[int, Event] | None = None, max_steps: int = 600
) -> tuple[Collector, Counter[str]]:
    """Run the jobs to the end on the test's thread (`events` before the steps they are keyed by); the engine's
    step counts, with "preempted" (the requests the scheduler preempted), "computed" (the tokens of the steps
    booked, as on_step tells: a row launched for a request that then stopped counts too), "passes" (the
    target's, booked or not) and "overlapped with a queue" (overlapped steps while a request waited). Every
    block is free at the end, and no request ever held blocks past the context."""
    engine, scheduler, sink, events = session.engine, session.engine.scheduler, Collector(), events or {}
    engine.step_counts.clear()
    engine.runner.step_counts.clear()
    seen: Counter[str] = Counter()
    schedule, reserve = scheduler.schedule, scheduler.reserve

    def counting_schedule() -> ScheduledStep:
        step = schedule()
        seen["preempted"] += len(step.preempted)
        return step

    def bounded_reserve(request: Request, positions: int, cached: list[int] | None = None) -> bool:
        assert scheduler.max_model_len is None or positions <= scheduler.max_model_len, (positions, request)
        return reserve(request, positions, cached)

    def on_step(computed: int, generated: int, seconds: float) -> None:
        seen["computed"] += computed

    scheduler.schedule, scheduler.reserve = counting_schedule, bounded_reserve  # type: ignore[method-assign]
    engine.on_step = on_step
    for request_id, job in jobs.items():
        add(session, sink, request_id, job)
    engine._drain_commands()
    for step in range(max_steps):
        if step in events:
            events[step](session, sink)
            engine._drain_commands()
        if not engine._has_work() and step > max(events, default=-1):
            engine._flush_outbox()
            break
        queued, overlapped = bool(scheduler.waiting), engine.step_counts[OVERLAPPED]
        engine.step()
        seen["overlapped with a queue"] += queued and engine.step_counts[OVERLAPPED] > overlapped
        engine._drain_commands()
    else:
        raise AssertionError(f"still working after {max_steps} steps")
    assert session.kv_cache.allocator.num_free == session.kv_cache.num_blocks
    seen["passes"] = sum(engine.runner.step_counts.values())
    return sink, Counter(engine.step_counts) + seen


def outputs_of(output: RequestOutput) -> tuple:
    error = (type(output.error), str(output.error)) if output.error is not None else None
    return output.token_ids, output.finish, error, output.logprobs


def overlapped_and_serial(
    jobs: Jobs,
    events: dict[int, Event] | None = None,
    setup: Callable[[ModelSession], None] | None = None,
    **session_args: int,
) -> tuple[Collector, Counter[str], Counter[str]]:
    """The jobs with the overlap on and with the serial switch (EngineSettings.overlap_decode), each on a fresh
    session (`setup` first): every output the same. Returns the overlapped run's outputs, and both runs' step
    counts."""
    sessions = [tiny_session(overlap_decode=overlap, **session_args) for overlap in (True, False)]
    for session in sessions:
        if setup is not None:
            setup(session)
    on, counts = generate(sessions[0], jobs, events)
    off, serial = generate(sessions[1], jobs, events)
    assert serial[OVERLAPPED] == serial[ON_DEVICE] == 0, serial
    assert sorted(on.outputs) == sorted(off.outputs)
    for request_id, outputs in off.outputs.items():
        assert [outputs_of(o) for o in on.outputs[request_id]] == [outputs_of(o) for o in outputs], request_id
    return on, counts, serial


@pytest.mark.parametrize("lengths", [[20], [3, 9, 14, 20]])
def test_batches_of_one_and_several_match_serial_and_the_reference(lengths: list[int], model: DecoderModel) -> None:
    prompts = random_prompts(len(lengths), seed=1)
    jobs = {f"r{i}": Job(p, greedy(n), n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))}
    sink, counts, serial = overlapped_and_serial(jobs)
    for request_id, job in jobs.items():
        assert sink.tokens(request_id) == greedy_reference(model, job.prompt, job.max_tokens), request_id
        assert sink.finish_reason(request_id) == "length"
    # Every decode step but the first of each steady stretch overlapped its predecessor's booking; the host path
    # ran the prefills (and, at most, the step where the first prefill overlaps the other's).
    decode_steps = max(lengths) - 1
    assert counts[OVERLAPPED] >= decode_steps - 3, counts
    assert counts[OVERLAPPED] + counts[ON_DEVICE] + counts["host"] == serial["host"], (counts, serial)
    # No row, and no pass, for a request past its max_tokens.
    assert (counts["computed"], counts["passes"]) == (serial["computed"], serial["passes"]), (counts, serial)


def test_stop_tokens_and_eos_at_different_steps(model: DecoderModel) -> None:
    prompts = random_prompts(4, seed=2)
    references = [greedy_reference(model, p, 16) for p in prompts]
    jobs: Jobs = {}
    for index, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        at = 2 + 3 * index  # where it stops: a token first seen there
        at = next(i for i in range(at, 16) if reference[i] not in reference[:i])
        stop = frozenset({reference[at]})
        eos = index % 2 == 1  # every other one by its EOS instead of a stop token
        settings = greedy(16) if eos else greedy(16, stop_token_ids=stop)
        jobs[f"r{index}"] = Job(prompt, settings, 16, eos=stop if eos else None)
    sink, counts, _ = overlapped_and_serial(jobs)
    for (request_id, job), reference in zip(jobs.items(), references, strict=True):
        stop = job.eos or job.settings.stop_token_ids
        first = next(i for i, t in enumerate(reference) if t in stop)
        assert sink.tokens(request_id) == reference[: first + 1] and sink.finish_reason(request_id) == "stop"
    assert counts[OVERLAPPED] > 0, counts


def test_abort_and_arrival_mid_run(model: DecoderModel) -> None:
    prompts = random_prompts(4, seed=3)
    jobs = {f"r{i}": Job(p, greedy(18), 18) for i, p in enumerate(prompts[:3])}
    late = Job(prompts[3], greedy(10), 10)
    events: dict[int, Event] = {
        6: lambda session, _: session.engine.abort(["r1"]),
        9: lambda session, sink: add(session, sink, "late", late),
    }
    sink, counts, _ = overlapped_and_serial(jobs, events)
    assert sink.finish_reason("r1") == "abort" and 0 < len(sink.tokens("r1")) < 18
    assert sink.tokens("r1") == greedy_reference(model, prompts[1], 18)[: len(sink.tokens("r1"))]
    for request_id, job in {**jobs, "late": late}.items():
        if request_id != "r1":
            assert sink.tokens(request_id) == greedy_reference(model, job.prompt, job.max_tokens), request_id
    assert counts[OVERLAPPED] > 0, counts


def test_a_queue_behind_a_full_batch(model: DecoderModel) -> None:
    """max_num_seqs 2 and four requests: the queue waits for a finish while the batch overlaps, as it would
    serially; each finish (stops, lengths) lets the next one in."""
    prompts = random_prompts(4, seed=11)
    references = [greedy_reference(model, p, 14) for p in prompts]
    jobs = {f"r{i}": Job(p, greedy(6 + 2 * i), 6 + 2 * i) for i, p in enumerate(prompts[:3])}
    jobs["stops"] = Job(prompts[3], greedy(14, stop_token_ids=frozenset({references[3][4]})), 14)
    sink, counts, _ = overlapped_and_serial(jobs, max_num_seqs=2)
    for index, request_id in enumerate(jobs):
        job = jobs[request_id]
        expected = greedy_reference(model, job.prompt, job.max_tokens, job.settings.stop_token_ids)
        assert sink.tokens(request_id) == expected == references[index][: len(expected)], request_id
    assert counts["overlapped with a queue"] > 0, counts


def test_prefix_caching_with_stops_and_a_second_wave(model: DecoderModel) -> None:
    """Requests sharing two prompt blocks stop at different steps (their rows of the step after are dropped, their
    blocks freed meanwhile); a second wave takes the cached prefixes and must read the right K/V."""
    shared = random_prompts(1, seed=4, longest=2)[0] * 16  # 32 tokens: two whole blocks
    tails = random_prompts(3, seed=5, longest=12)
    first_wave = {f"a{i}": shared + tail for i, tail in enumerate(tails)}
    references = {rid: greedy_reference(model, prompt, 12) for rid, prompt in first_wave.items()}
    jobs = {
        rid: Job(prompt, greedy(12, stop_token_ids=frozenset({references[rid][3 + 3 * i]})), 12)
        for i, (rid, prompt) in enumerate(first_wave.items())
    }
    second = {f"b{i}": Job(prompt, greedy(12), 12) for i, prompt in enumerate(first_wave.values())}
    events: dict[int, Event] = {40: lambda session, sink: [add(session, sink, rid, job) for rid, job in second.items()]}
    sink, counts, _ = overlapped_and_serial(jobs, events)
    for index, rid in enumerate(first_wave):
        assert sink.tokens(f"b{index}") == references[rid], rid
        finish = sink.outputs[f"b{index}"][-1].finish
        assert finish is not None and finish.cached_prompt_tokens >= 32
    assert counts[OVERLAPPED] > 0, counts


def test_preemption_in_a_tiny_cache(model: DecoderModel) -> None:
    prompts = [[(7 * i + j) % VOCAB for j in range(30 + i)] for i in range(4)]
    jobs = {f"r{i}": Job(p, greedy(24), 24) for i, p in enumerate(prompts)}
    sink, counts, serial = overlapped_and_serial(jobs, num_kv_blocks=12, max_num_batched_tokens=64)
    assert counts["preempted"] and serial["preempted"], "the cache was sized to force preemption"
    for request_id, job in jobs.items():
        assert sink.tokens(request_id) == greedy_reference(model, job.prompt, 24), request_id
    assert counts[OVERLAPPED] > 0, counts


def test_penalised_requests_through_preemption() -> None:
    """Penalised requests asking for logprobs, preempted and recomputed in a tiny cache: their slots keep the counts
    across the preemption (the same tokens and logprobs as the serial path)."""
    prompts = [[(7 * i + j) % VOCAB for j in range(30 + i)] for i in range(4)]
    settings = greedy(24, frequency_penalty=0.3, logprobs=1)
    jobs = {f"r{i}": Job(p, settings, 24) for i, p in enumerate(prompts)}
    _, counts, serial = overlapped_and_serial(jobs, num_kv_blocks=12, max_num_batched_tokens=64)
    assert counts["preempted"] and serial["preempted"], "the cache was sized to force preemption"
    assert counts[OVERLAPPED] > 0, counts


def context_of(length: int) -> Callable[[ModelSession], None]:
    """A context of `length` tokens (a synthetic target's is 8192: more than the tiny cache holds)."""

    def setup(session: ModelSession) -> None:
        engine = session.engine
        engine.max_model_len = engine.scheduler.max_model_len = length
        if engine.overlap is not None:
            engine.overlap.max_model_len = length

    return setup


def test_the_context_end_ends_the_chain_up_front(model: DecoderModel) -> None:
    """A request reaching max_model_len (here 512) has no row in the step after its last one; the other goes on."""
    long, short = random_prompts(1, seed=6, longest=2)[0] * 250, random_prompts(1, seed=7)[0]
    jobs = {"long": Job(long, greedy(30), 30), "short": Job(short, greedy(20), 20)}
    sink, counts, serial = overlapped_and_serial(jobs, setup=context_of(512))
    assert sink.tokens("long") == greedy_reference(model, long, 12) and sink.finish_reason("long") == "length"
    assert sink.tokens("short") == greedy_reference(model, short, 20)
    assert counts[OVERLAPPED] > 0, counts
    assert (counts["computed"], counts["passes"]) == (serial["computed"], serial["passes"]), (counts, serial)


def test_seeded_sampling_draws_the_serial_tokens(model: DecoderModel) -> None:
    prompts = random_prompts(4, seed=8)
    sampled = [
        SamplingSettings(temperature=0.8, top_p=0.9, top_k=50, seed=11, max_tokens=14),
        SamplingSettings(temperature=1.2, seed=12, max_tokens=10),
        SamplingSettings(temperature=0.7, min_p=0.05, seed=13, max_tokens=14),
    ]
    jobs = {f"s{i}": Job(p, s, s.max_tokens or 0) for i, (p, s) in enumerate(zip(prompts, sampled, strict=False))}
    jobs["g"] = Job(prompts[3], greedy(14), 14)
    sink, counts, _ = overlapped_and_serial(jobs)
    assert sink.tokens("g") == greedy_reference(model, prompts[3], 14)
    assert sink.tokens("s0") != greedy_reference(model, prompts[0], 14)  # it did sample
    assert counts[OVERLAPPED] > 0, counts


def test_penalties_bias_and_logprobs_overlap_and_match_serial() -> None:
    """Penalised and biased requests (greedy and sampled) and requests asking for logprobs, beside plain ones, of
    different lengths: the same tokens and logprobs as the serial path, while the steady stretches overlap."""
    prompts = random_prompts(6, seed=9)
    jobs = {
        "penalised": Job(prompts[0], greedy(16, repetition_penalty=1.3, frequency_penalty=0.4), 16),
        "logprobs": Job(prompts[1], greedy(12, logprobs=2), 12),
        "sampled": Job(prompts[2], SamplingSettings(0.9, top_k=40, presence_penalty=0.8, seed=5, logprobs=0), 18),
        "biased": Job(prompts[3], greedy(10, logit_bias=((7, 5.0), (11, -100.0))), 10),
        "plain": Job(prompts[4], greedy(20), 20),
        "plain sampled": Job(prompts[5], SamplingSettings(0.7, seed=6), 14),
    }
    sink, counts, _ = overlapped_and_serial(jobs)
    assert sink.outputs["logprobs"][-1].logprobs and sink.outputs["sampled"][-1].logprobs
    assert counts[OVERLAPPED] >= 8, counts


def test_penalties_count_tokens_from_the_prefill_and_serial_steps() -> None:
    """A penalised request joining a running batch: its first token comes from the serial path (the prefill's
    step), the next ones overlapped; a repetition-heavy penalty makes any missed count change the tokens."""
    prompts = random_prompts(2, seed=13)
    jobs = {
        "first": Job(prompts[0], greedy(40, frequency_penalty=0.15), 40),  # repeats, broken by the counts
        "second": Job(prompts[1], greedy(24, repetition_penalty=2.0, presence_penalty=2.0), 24),
    }

    def arrive(session: ModelSession, sink: Collector) -> None:
        add(session, sink, "late", Job(prompts[0][:5], greedy(12, frequency_penalty=2.0), 12))

    _, counts, _ = overlapped_and_serial(jobs, events={6: arrive})
    assert counts[OVERLAPPED] > 0, counts


def test_logits_that_are_not_finite_fail_their_request_alone() -> None:
    """The 5th target pass's first row is NaN: that request fails with the host path's error, the rest go on."""
    prompts = random_prompts(2, seed=10)
    jobs = {f"r{i}": Job(p, greedy(12), 12) for i, p in enumerate(prompts)}
    runs = []
    for overlap in (True, False):
        session = tiny_session(overlap_decode=overlap)
        execute, calls = session.engine.runner.execute, Counter[str]()

        def poisoned(inputs: StepInputs, execute=execute, calls=calls) -> StepOutput:  # type: ignore[no-untyped-def]
            output = execute(inputs)
            calls["n"] += 1
            if calls["n"] == 5:
                with torch.inference_mode():
                    output.logits[0] = float("nan")
            return output

        session.engine.runner.execute = poisoned  # type: ignore[method-assign]
        runs.append(generate(session, jobs))
    (on, counts), (off, _) = runs
    failed = [rid for rid in jobs if on.outputs[rid][-1].error is not None]
    assert len(failed) == 1 and "not finite" in str(on.outputs[failed[0]][-1].error)
    for request_id in jobs:
        assert [outputs_of(o) for o in on.outputs[request_id]] == [outputs_of(o) for o in off.outputs[request_id]]
    assert counts[OVERLAPPED] > 0, counts


def test_following_inputs_are_what_the_host_builds_after_booking() -> None:
    """The step launched before its predecessor's read-back has the input ids, positions, slots, sequence lengths
    and block table that runner.prepare builds from the requests once the predecessor is booked."""
    session = tiny_session()
    engine, overlap = session.engine, session.engine.overlap
    assert overlap is not None
    decode_inputs = overlap.decode_inputs
    launched: list[tuple[list[Request], StepInputs]] = []

    def recording(requests: list[Request], positions: list[int], input_ids: torch.Tensor) -> StepInputs:
        inputs = decode_inputs(requests, positions, input_ids)
        launched.append((list(requests), inputs))
        return inputs

    overlap.decode_inputs = recording  # type: ignore[method-assign]
    for index, prompt in enumerate(random_prompts(3, seed=12)):
        add(session, Collector(), f"r{index}", Job(prompt, greedy(8 + 4 * index), 8 + 4 * index))
    engine._drain_commands()
    checked = 0
    while engine._has_work():
        before = len(launched)
        engine.step()
        if len(launched) == before:
            continue
        requests, derived = launched[-1]
        built = engine.runner.prepare(ScheduledStep(requests, [1] * len(requests)))
        assert derived.input_ids.tolist() == built.input_ids.tolist()
        assert derived.positions.tolist() == built.positions.tolist()
        step, expected = derived.attention, built.attention
        for name in ("block_table", "query_start_loc", "seq_lens", "slot_mapping"):
            assert getattr(step, name).tolist() == getattr(expected, name).tolist(), name
        assert (step.max_query_len, step.max_seq_len) == (expected.max_query_len, expected.max_seq_len)
        assert derived.logits_indices.tolist() == built.logits_indices.tolist()
        assert (derived.sampled, derived.row_starts, derived.uniform_query_len) == (
            built.sampled,
            built.row_starts,
            built.uniform_query_len,
        )
        checked += 1
    assert checked >= 10 and {len(r) for r, _ in launched} == {1, 2, 3}

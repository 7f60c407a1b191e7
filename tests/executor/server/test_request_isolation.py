"""One request's bad numbers fail that request alone: sampling values are checked at admission (a tiny
temperature is greedy), a distribution that is not one (NaN, inf) fails its own request in sampling and in
verification, and draft ids outside the vocabulary from a faulty drafter are never emitted or embedded."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_driving import Outputs, run_bounded
from executor_builders import TINY, greedy, tiny_session
from greedy_reference import greedy_reference
from host_verify_runs import request_of
from spec_builders import spec_session

from executor_service.engine.request import Request
from executor_service.engine.scheduler import ScheduledStep
from executor_service.runner.model_runner import StepInputs, StepOutput
from executor_service.sample.sampling import DraftProbs, SamplingSettings
from executor_service.server.session import ModelSession
from executor_service.server.validation import ModelLimits, check_generate
from executor_service.spec_decode.host_verify import TreeVerdict, VerifyError, verify_on_host
from specdec.v1 import executor_pb2
from specdec_runtime.errors import InvalidArgument

VOCAB = TINY["vocab_size"]
LIMITS = ModelLimits(vocab_size=VOCAB, max_model_len=8192, capacity_tokens=1024, has_tokenizer=False)
PROMPTS = {"a": [5, 9, 33, 2], "b": [7, 7, 1], "c": [100, 3, 250, 17, 8]}


def generate_request(**sampling: float) -> executor_pb2.GenerateRequest:
    return executor_pb2.GenerateRequest(
        request_id="r", token_ids=executor_pb2.TokenIds(ids=[1, 2, 3]), sampling=executor_pb2.SamplingParams(**sampling)
    )


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": -math.inf}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"temperature": -1e-45}, "sampling.temperature"),
        ({"top_p": math.nan}, "sampling.top_p"),
        ({"top_p": math.inf}, "sampling.top_p"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
    ],
)
def test_bad_sampling_values_are_invalid_argument(sampling: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_generate(generate_request(**sampling), LIMITS, None)
    assert [v.field for v in err.value.field_violations] == [field]


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 9e-6])
def test_a_tiny_temperature_is_greedy_and_its_batch_goes_on(temperature: float) -> None:
    """1e-38 made softmax NaN, and the INTERNAL error reached every stream of the step."""
    _, settings, _ = check_generate(generate_request(temperature=temperature, max_tokens=8), LIMITS, None)
    assert settings.greedy
    session, outputs = tiny_session(), Outputs()
    add(session, "tiny", PROMPTS["a"], settings, outputs)
    add(session, "greedy", PROMPTS["b"], greedy(8), outputs)
    add(session, "sampled", PROMPTS["c"], SamplingSettings(temperature=0.8, max_tokens=8, seed=3), outputs)
    run_bounded(session.engine)
    assert outputs.tokens("tiny") == greedy_reference(session.loaded.model, PROMPTS["a"], 8)
    assert outputs.tokens("greedy") == greedy_reference(session.loaded.model, PROMPTS["b"], 8)
    assert all(outputs.finish_reason(rid) == "length" for rid in ("tiny", "greedy", "sampled"))


def test_a_distribution_that_is_not_one_fails_its_request_alone() -> None:
    """A NaN temperature (past validation, as a caller inside the process could send) gives NaN probabilities;
    the seeded and greedy requests of the same steps get exactly what they get without it."""
    session = tiny_session()
    seeded = SamplingSettings(temperature=0.8, top_p=0.9, max_tokens=8, seed=11)
    alone = Outputs()
    add(session, "seeded", PROMPTS["c"], seeded, alone)
    run_bounded(session.engine)
    outputs = Outputs()
    add(session, "nan", PROMPTS["a"], SamplingSettings(temperature=math.nan, max_tokens=8, seed=1), outputs)
    add(session, "greedy", PROMPTS["b"], greedy(8), outputs)
    add(session, "seeded", PROMPTS["c"], seeded, outputs)
    run_bounded(session.engine)
    assert isinstance(outputs.error("nan"), VerifyError)
    assert "distribution" in str(outputs.error("nan"))
    assert outputs.tokens("greedy") == greedy_reference(session.loaded.model, PROMPTS["b"], 8)
    assert outputs.tokens("seeded") == alone.tokens("seeded") and len(alone.tokens("seeded")) == 8
    assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0


def test_logits_that_are_not_finite_fail_their_greedy_request_alone() -> None:
    session, outputs = tiny_session(), Outputs()
    poison_logits(session, "poisoned", after_steps=2)
    for rid, prompt in PROMPTS.items():
        add(session, rid, prompt, greedy(8), outputs)
    add(session, "poisoned", [4, 4, 4], greedy(8), outputs)
    run_bounded(session.engine)
    assert isinstance(outputs.error("poisoned"), VerifyError) and "not finite" in str(outputs.error("poisoned"))
    for rid, prompt in PROMPTS.items():
        assert outputs.tokens(rid) == greedy_reference(session.loaded.model, prompt, 8), rid
    assert session.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize("bad", [-1, VOCAB, 2**40])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_a_draft_outside_the_vocabulary_is_never_emitted(bad: int, with_draft_probs: bool) -> None:
    """The target is sure of the last id, which a raw index of -1 would read: the draft would be accepted and
    emitted. Its request fails alone; the request beside it is verified as usual."""
    logits = torch.full((6, VOCAB), -30.0)
    logits[:, VOCAB - 1] = 0.0
    settings = SamplingSettings(temperature=0.9)
    requests = [request_of(settings, 1), request_of(settings, 2)]
    uniform = DraftProbs(torch.arange(VOCAB).expand(2, VOCAB), torch.full((2, VOCAB), 1.0 / VOCAB))
    probs = [uniform, uniform] if with_draft_probs else None
    found = verify_on_host(logits, requests, [[VOCAB - 1, bad], [VOCAB - 1, VOCAB - 1]], probs)
    assert isinstance(found[0], VerifyError) and "outside the vocabulary" in str(found[0])
    assert found[1] == TreeVerdict([0, 1], [VOCAB - 1] * 3)


def test_verify_on_host_fails_only_the_requests_with_bad_drafts_or_logits() -> None:
    logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(3))  # 2 rows per request
    logits[9, 4] = math.nan
    settings = [greedy(), greedy(), SamplingSettings(temperature=0.9), SamplingSettings(temperature=0.9), greedy()]
    drafts = [[int(logits[0].argmax())], [-3], [VOCAB + 1], [2], [5]]
    found = verify_on_host(logits, [request_of(s, i) for i, s in enumerate(settings)], drafts)
    assert found[0] == TreeVerdict([0], [int(logits[0].argmax()), int(logits[1].argmax())])
    for index in (1, 2):
        assert isinstance(found[index], VerifyError) and "outside the vocabulary" in str(found[index])
    assert isinstance(found[3], TreeVerdict) and all(0 <= t < VOCAB for t in found[3].emitted)
    assert isinstance(found[4], VerifyError) and "not finite" in str(found[4])


@pytest.mark.parametrize(("method", "bad"), [("eagle", -1), ("dflash", VOCAB), ("eagle3", -7)])
def test_a_drafter_proposing_ids_outside_the_vocabulary_fails_that_request_alone(method: str, bad: int) -> None:
    """Before: the id reached the target's embedding and failed every request of the step."""
    session, outputs = spec_session(method, 3), Outputs()
    assert session.proposer is not None
    session.proposer.replay = lambda request, drafts: [bad] * len(drafts) if request.request_id == "faulty" else drafts
    add(session, "faulty", [9, 8, 7], greedy(10), outputs)
    for rid, prompt in PROMPTS.items():
        add(session, rid, prompt, greedy(10), outputs)
    add(session, "sampled", [3, 1, 4, 1, 5], SamplingSettings(temperature=0.9, max_tokens=10, seed=2), outputs)
    run_bounded(session.engine)
    error = outputs.error("faulty")
    assert isinstance(error, VerifyError) and "outside the vocabulary" in str(error)
    assert all(0 <= t < VOCAB for t in outputs.tokens("faulty"))
    for rid, prompt in PROMPTS.items():
        assert outputs.tokens(rid) == greedy_reference(session.loaded.model, prompt, 10), rid
    assert outputs.finish_reason("sampled") == "length" and len(outputs.tokens("sampled")) == 10
    assert session.kv_cache.allocator.num_used == 0 and session.engine.num_live == 0


def add(session: ModelSession, rid: str, prompt: list[int], settings: SamplingSettings, outputs: Outputs) -> None:
    max_tokens = settings.max_tokens or 8
    session.engine.add(session.new_request(rid, prompt, settings, max_tokens, outputs))


def poison_logits(session: ModelSession, request_id: str, after_steps: int) -> None:
    """Make the target's logits rows of `request_id` NaN in every step after the first `after_steps`."""
    runner = session.engine.runner
    prepare, execute = runner.prepare, runner.execute
    rows: list[int] = []
    steps = [0]

    def prepare_and_find(step: ScheduledStep, *args: bool) -> StepInputs:
        inputs = prepare(step, *args)
        rows.clear()
        start = 0
        for index, num_drafts in zip(inputs.sampled, inputs.num_drafts, strict=True):
            if step.requests[index].request_id == request_id:
                rows.extend(range(start, start + num_drafts + 1))
            start += num_drafts + 1
        return inputs

    def execute_and_poison(inputs: StepInputs) -> StepOutput:
        output = execute(inputs)
        steps[0] += 1
        if steps[0] > after_steps:
            with torch.inference_mode():  # the runner's outputs are inference tensors
                output.logits[rows] = math.nan
        return output

    runner.prepare = prepare_and_find  # type: ignore[method-assign]
    runner.execute = execute_and_poison  # type: ignore[method-assign]
    overlap = session.engine.overlap
    if overlap is not None:  # an overlapped decode step's following step builds its inputs there, not in prepare
        decode_inputs = overlap.decode_inputs

        def decode_inputs_and_find(requests: list[Request], *args: Any) -> StepInputs:
            rows[:] = [i for i, r in enumerate(requests) if r.request_id == request_id]
            return decode_inputs(requests, *args)

        overlap.decode_inputs = decode_inputs_and_find  # type: ignore[method-assign]

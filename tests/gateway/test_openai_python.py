"""The official `openai` Python package against the gateway in front of a real executor (tests/gateway/conftest.py):
chat and completions, streamed and not, usage with the speculative statistics, log probabilities, stop strings,
seeds, per-request num_speculative_tokens, /v1/models, and the answers the SDK reads from the executor's gRPC
statuses. Greedy requests (temperature 0) make every comparison exact."""

from __future__ import annotations

import grpc
import pytest
from gateway_stack import MODEL, TOKEN

from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.auth import bearer_metadata

openai = pytest.importorskip("openai", reason="pip install openai (the dev extra)")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "max_tokens": 24}


def direct_generate(stack, request: executor_pb2.GenerateRequest) -> tuple[str, list[int], executor_pb2.Finished]:
    """The same request straight to the executor over gRPC: text, token ids and the final statistics."""
    with grpc.insecure_channel(stack.executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        chunks = list(stub.Generate(request, metadata=bearer_metadata(TOKEN), timeout=60))
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finished


def test_chat_equals_the_executors_own_answer_with_speculative_usage(stack):
    answer = stack.client().chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    request = executor_pb2.GenerateRequest(request_id="direct-chat")
    for message in CHAT:
        request.messages.messages.add(**message)
    request.sampling.max_tokens = 24
    text, _, finished = direct_generate(stack, request)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == finished.finish_reason
    assert answer.object == "chat.completion" and answer.model == MODEL and answer.id.startswith("chatcmpl-")
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (finished.prompt_tokens, finished.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    speculative = usage.model_extra["speculative"]
    assert speculative["drafted_tokens"] > 0  # the EAGLE-3 drafter drafted
    assert speculative["drafted_tokens"] == finished.drafted_tokens
    assert speculative["mean_acceptance_length"] >= 1.0
    assert len(speculative["acceptance_rate_per_position"]) == 3


def test_a_stream_joins_to_the_whole_answer_and_ends_with_usage(stack):
    client = stack.client()
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_from_text_and_from_token_ids(stack):
    client = stack.client()
    answer = client.completions.create(model=MODEL, prompt="abc def", temperature=0, max_tokens=12)
    request = executor_pb2.GenerateRequest(request_id="direct-text", text="abc def")
    request.sampling.max_tokens = 12
    text, _, finished = direct_generate(stack, request)
    assert answer.object == "text_completion" and answer.choices[0].text == text
    assert answer.usage.completion_tokens == finished.completion_tokens
    ids = client.completions.create(model=MODEL, prompt=[5, 17, 42, 7], temperature=0, max_tokens=8)
    request = executor_pb2.GenerateRequest(request_id="direct-ids", token_ids=executor_pb2.TokenIds(ids=[5, 17, 42, 7]))
    request.sampling.max_tokens = 8
    assert ids.choices[0].text == direct_generate(stack, request)[0]
    streamed = client.completions.create(model=MODEL, prompt="abc def", temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_default_max_tokens_of_completions_is_openais_16(stack):
    answer = stack.client().completions.create(
        model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


def test_logprobs_come_from_the_target_one_per_token(stack):
    client = stack.client()
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.token.startswith("token_id:") and len(entry.top_logprobs) == 3
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.logprob == pytest.approx(tops[0])
    completion = client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=6, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_a_stop_string_ends_the_text_before_it(stack):
    client = stack.client()
    free = client.completions.create(
        model=MODEL, prompt="abc", temperature=0, max_tokens=24, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop.strip(), text
    stopped = client.completions.create(model=MODEL, prompt="abc", temperature=0, max_tokens=24, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, stop=stop, **GREEDY)
    assert stop not in chat.choices[0].message.content


def test_a_seed_makes_sampling_repeatable(stack):
    client = stack.client()

    def sampled(seed: int) -> str:
        answer = client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=1.0, top_p=0.95, seed=seed, max_tokens=16
        )
        return answer.choices[0].message.content

    first = sampled(11)
    assert sampled(11) == first
    assert len({first, sampled(12), sampled(13), sampled(14)}) > 1


def test_n_choices_greedy_are_the_one_answer_n_times(stack):
    client = stack.client()
    one = client.completions.create(
        model=MODEL, prompt="abc", temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    three = client.completions.create(
        model=MODEL, prompt="abc", temperature=0, max_tokens=12, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in three.choices] == [0, 1, 2] and len({c.text for c in three.choices}) == 1
    assert three.choices[0].text == one.choices[0].text
    assert three.id.startswith("cmpl-") and three.id.count("-") == 1  # the request's id, not a choice's
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (one.usage.prompt_tokens, 36)
    speculative = three.usage.model_extra["speculative"]
    assert speculative["drafted_tokens"] > 0 and speculative["mean_acceptance_length"] >= 1.0


def test_a_batch_of_prompts_answers_each_in_turn(stack):
    """A completion's prompt as an array (vLLM's and OpenAI's batch): n choices of each prompt in turn, each the
    prompt's own answer; usage counts every prompt once."""
    client = stack.client()
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    prompts = ["abc", [5, 17, 42, 7], "abc def"]
    alone = [client.completions.create(prompt=p, **greedy) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 36


def test_n_seeded_choices_are_the_seeds_one_by_one(stack):
    """Choice i of a seeded request is the same request alone with seed + i (vLLM's rule): reproducible, and
    the choices differ."""
    client = stack.client()
    sampled = {"model": MODEL, "messages": CHAT, "temperature": 1.0, "max_tokens": 16}
    together = client.chat.completions.create(n=3, seed=40, **sampled)
    alone = [client.chat.completions.create(seed=40 + i, **sampled).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in together.choices] == alone
    assert len(set(alone)) > 1


def test_n_streamed_choices_join_to_the_whole_answer(stack):
    client = stack.client()
    sampled = {"model": MODEL, "messages": CHAT, "temperature": 1.0, "max_tokens": 16, "seed": 7, "n": 2}
    whole = client.chat.completions.create(**sampled)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **sampled))
    texts, reasons, roles = ["", ""], [[], []], [[], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index].append(choice.delta.role)
        reasons[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert all(r[0] == "assistant" and not any(r[1:]) for r in roles)  # each choice's first chunk has the role
    assert [[x for x in r if x] for r in reasons] == [[c.finish_reason] for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logit_bias_forces_or_bans_tokens(stack):
    client = stack.client()
    greedy = {"model": MODEL, "prompt": [1, 2, 3], "temperature": 0, "max_tokens": 6, "logprobs": 0}
    forced = client.completions.create(logit_bias={"7": 100}, **greedy)
    assert forced.choices[0].logprobs.tokens == ["token_id:7"] * 6
    own = client.completions.create(**greedy).choices[0].logprobs.tokens
    banned = client.completions.create(logit_bias={t.removeprefix("token_id:"): -100 for t in own}, **greedy)
    assert not set(banned.choices[0].logprobs.tokens) & set(own)
    for bias, param in (
        ({"7": 101}, "logit_bias.7"),
        ({"seven": 1}, "logit_bias.seven"),
        ({"7": "up"}, "logit_bias.7"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(logit_bias=bias, **greedy)
        assert bad.value.body["param"] == param, bad.value.body
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(logit_bias={str(i): 1 for i in range(1025)}, **greedy)
    assert many.value.body["param"] == "logit_bias"


def test_num_speculative_tokens_per_request(stack):
    answer = stack.client().chat.completions.create(
        model=MODEL, messages=CHAT, extra_body={"num_speculative_tokens": 0}, **GREEDY
    )
    assert answer.usage.model_extra["speculative"]["drafted_tokens"] == 0
    assert answer.usage.completion_tokens > 0


def test_models_lists_the_loaded_model(stack):
    models = stack.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    details = models[0].model_extra["specdec"]
    assert details["spec_method"] == "SPEC_METHOD_EAGLE3" and details["num_speculative_tokens"] == 3
    client = stack.client()
    assert client.models.retrieve(MODEL) == models[0]  # GET /v1/models/{model}
    for other in ("gpt-4o", "x" * 5000, "a/b"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(other)
        assert missing.value.body["param"] == "model" and len(missing.value.message) < 300


def test_errors_come_back_as_the_sdks_exceptions(stack):
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as bad:  # the executor's INVALID_ARGUMENT, its field mapped back
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as role:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert role.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as too_long:  # prompt + max_tokens past the context
        client.completions.create(model=MODEL, prompt="abc", max_tokens=100_000)
    assert too_long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=129)
    assert n.value.body["param"] == "n" and "[1, 128]" in n.value.message
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        stack.client(api_key="wrong").chat.completions.create(model=MODEL, messages=CHAT)
    assert unauthenticated.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert missing.value.status_code == 404 and missing.value.body["param"] == "model"
    # The gateway keeps serving.
    assert client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY).choices[0].message.content

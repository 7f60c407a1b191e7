"""The HTTP gateway under fuzzing, in front of a real executor (the toy model and a synthetic EAGLE-3 drafter): chat
and completion bodies near a valid one, each of a few fields (known OpenAI ones, or unknown names) replaced by any
JSON value. Every answer must be one a client can act on: 200 with a whole answer or an event stream ending in
[DONE], or a 4xx / 429 / 503 in OpenAI's error shape with a short message; never a 500 or 502, never a hang. After
the examples the gateway still serves and holds no open generation."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette", reason="the gateway needs the gateway extra: pip install -e '.[gateway]'")

from gateway_stack import MODEL, start_executor
from server_processes import ServerProcess, spawn_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0}
FIELDS = (  # every field the gateway reads, and names it does not know
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "seed",
    "logprobs", "top_logprobs", "num_speculative_tokens", "n", "user", "stream", "stream_options", "echo", "suffix",
    "best_of", "logit_bias", "tools", "tool_choice", "response_format", "frobnicate",
)  # fmt: skip
ALLOWED = {200, 400, 401, 404, 413, 429, 503}
MAX_MESSAGE_CHARS = 1200  # the gateway echoes at most 1 KiB of what it was sent
SMALL = 4  # n and max_tokens past this are cut to it when they are valid: an example stays quick on 2 cores

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 7, 100, 101, 128, 129, 2**31, -(2**31) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "7", "-7", "chat", "text", "none", "assistant", "\x00", "é" * 300]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=12) | st.sampled_from(["7", "role"]), inner, max_size=5),
    ),
    max_leaves=12,
)


# Values a client would send for some fields, so that the examples also reach streams, several choices and biases.
PLAUSIBLE = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, SMALL),
    "temperature": st.floats(0, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=4),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "max_tokens": st.integers(1, SMALL),
    "num_speculative_tokens": st.integers(0, 3),
    "top_k": st.integers(-1, 50),
    "repetition_penalty": st.floats(0.5, 2),
    "prompt": st.one_of(
        st.text(max_size=8),
        st.lists(st.integers(0, 300), min_size=1, max_size=5),
        st.lists(st.text(max_size=5) | st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1, max_size=3),
    ),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["chat", "completion"]))
    body = dict(CHAT if route == "chat" else COMPLETION)
    valid_mostly = draw(st.booleans())  # half the examples change only fields with a plausible value, to one
    names = sorted(PLAUSIBLE) if valid_mostly else FIELDS
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)):
        body[name] = draw(PLAUSIBLE[name] if valid_mostly else values)
    for name in ("n", "max_tokens", "max_completion_tokens"):  # valid large values: cut (invalid ones stay)
        value = body.get(name)
        if type(value) is int and SMALL < value <= 2**31:
            body[name] = SMALL
    return route, body


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("gateway-fuzz")
    executor = start_executor(directory, "executor")
    try:
        gateway = spawn_server("gateway", "gateway", directory, "--executor", executor.address,
                               "--served-model-name", MODEL, "--request-timeout", "60")  # fmt: skip
    except BaseException:
        executor.stop()
        raise
    yield gateway
    statuses = {"gateway": gateway.stop(), "executor": executor.stop()}
    assert statuses == {"gateway": 0, "executor": 0}, f"{gateway.log()[-3000:]}\n{executor.log()[-3000:]}"


def post(gateway: ServerProcess, route: str, body: dict[str, Any]) -> tuple[int, str]:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    data = json.dumps(body).encode()  # NaN and the infinities as JSON's extension literals, as some clients send
    request = urllib.request.Request(f"http://{gateway.address}{path}", data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=90) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def check_answer(status: int, text: str, body: dict[str, Any]) -> None:
    where = f"{status} to {json.dumps(body)[:600]}: {text[:600]}"
    assert status in ALLOWED, where
    if status != 200:
        error = json.loads(text)["error"]
        assert set(error) >= {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and len(error["message"]) <= MAX_MESSAGE_CHARS, where
        return
    if text.startswith("data: "):
        events = text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], where
        for event in events[:-2]:
            payload = json.loads(event.removeprefix("data: "))
            assert "error" not in payload, where  # a healthy stack streams no error
        return
    answer = json.loads(text)
    n = body.get("n") if type(body.get("n")) is int else 1
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is not int  # a completion's prompts
    expected = (n or 1) * (len(prompt) if batch and "messages" not in body else 1)
    assert [c["index"] for c in answer["choices"]] == list(range(expected)), where
    assert answer["usage"]["completion_tokens"] >= 0, where


@given(example=bodies())
def test_any_body_gets_an_answer_a_client_can_act_on(gateway: ServerProcess, example: tuple[str, dict]) -> None:
    route, body = example
    check_answer(*post(gateway, route, body), body)


def test_the_gateway_still_serves_and_holds_nothing(gateway: ServerProcess) -> None:
    status, text = post(gateway, "chat", CHAT)
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] is not None
    with urllib.request.urlopen(f"http://{gateway.address}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert "specdec_gateway_open_generations 0.0" in metrics, metrics[-2000:]

"""Callers that send what no SDK would: each gets a clear 4xx in OpenAI's error shape, `param` naming the field,
nothing echoed at length, and the gateway keeps serving (a good request after them all still works)."""

from __future__ import annotations

import json
import re
import socket
import time
from http.client import HTTPConnection

import pytest
from gateway_stack import MODEL, TOKEN, http

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def post(stack, body, path: str = "/v1/chat/completions", headers: dict | None = None) -> tuple[int, dict]:
    return http("POST", f"http://{stack.gateway.address}{path}", body, {**AUTH, **(headers or {})})


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": 3000, "max_completion_tokens": 4000}, "max_tokens"),
        ({"top_p": [1]}, "top_p"),
        ({"seed": 2**70}, "seed"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": [7]}, "stop[0]"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"n": 129}, "n"),
        ({"n": 0}, "n"),
        ({"n": "3"}, "n"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"logit_bias": [7]}, "logit_bias"),
        ({"logit_bias": {"-7": 1}}, "logit_bias.-7"),
        ({"logit_bias": {"7": None}}, "logit_bias.7"),
        ({"logit_bias": {"99999999999": 1}}, "logit_bias.99999999999"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour"),
        ({"user": 12}, "user"),
        ({"model": ["toy"]}, "model"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(stack, change, param):
    status, body = post(stack, {**CHAT, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


def test_n_copies_of_a_large_prompt_are_refused_before_they_are_built(stack):
    """n choices send the prompt n times: 128 copies of a 1 MiB prompt pass the gateway's bound (64 MiB) and are
    refused naming n; the same prompt with n = 2 is the executor's to judge (its context: 400 on the prompt)."""
    body = {"model": MODEL, "prompt": "ab " * (350 << 10), "max_tokens": 4}
    status, answer = post(stack, {**body, "n": 128}, "/v1/completions")
    assert status == 400 and answer["error"]["param"] == "n" and len(answer["error"]["message"]) < 300, answer
    status, answer = post(stack, {**body, "n": 2}, "/v1/completions")
    assert status == 400 and answer["error"]["param"] != "n", answer


def test_nan_and_infinity_are_refused_naming_the_field(stack):
    for literal in ("NaN", "Infinity", "-Infinity"):
        raw = json.dumps(CHAT)[:-1] + f', "temperature": {literal}}}'
        status, body = post(stack, raw.encode())
        assert status == 400 and body["error"]["param"] == "temperature", body


def test_a_completion_without_a_usable_prompt(stack):
    for prompt, param in ((None, "prompt"), ([], "prompt"), ([-1], "prompt"), ({"text": "x"}, "prompt"),
                          (["a", 5], "prompt[1]"), ([[1], []], "prompt[1]"), (["a"] * 129, "prompt")):  # fmt: skip
        status, body = post(stack, {"model": MODEL, "prompt": prompt}, "/v1/completions")
        assert status == 400 and body["error"]["param"] == param, (prompt, body)
    status, body = post(stack, {"model": MODEL, "prompt": "a", "echo": True}, "/v1/completions")
    assert status == 400 and body["error"]["param"] == "echo"


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"n": 1' + b"0" * 5000 + b"}"],
)
def test_a_body_that_is_not_one_json_object_is_a_400(stack, raw):
    status, body = post(stack, raw)
    assert status == 400 and body["error"]["code"] == "invalid_json", body
    assert len(body["error"]["message"]) <= 1024


def test_a_huge_body_is_refused_before_it_is_read(stack):
    """A declared length over the bound is refused before a byte of the body is sent; a chunked body (no length)
    as soon as it crosses the bound. The client then sends nothing more, and reads the answer."""
    declared = {"Content-Length": str(17 << 20)}
    assert huge_post(stack, declared, b"") == 413
    chunk = b"x" * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17))
    assert huge_post(stack, {"Transfer-Encoding": "chunked"}, chunks) == 413


def huge_post(stack, headers: dict[str, str], sent: bytes) -> int:
    connection = HTTPConnection(*stack.gateway.address.split(":"), timeout=60)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        for key, value in {**AUTH, "Content-Type": "application/json", **headers}.items():
            connection.putheader(key, value)
        connection.endheaders()
        connection.send(sent)
        answer = connection.getresponse()
        assert json.loads(answer.read())["error"]["code"] == "request_too_large"
        return answer.status
    finally:
        connection.close()


def test_other_methods_on_the_generation_routes_are_a_405(stack):
    """POST to the generation routes is served before starlette's router; every other method still reaches it."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        status, _ = http("GET", f"http://{stack.gateway.address}{path}", headers=AUTH)
        assert status == 405


def answered(stack, route: str, status: int) -> float:
    """specdec_gateway_requests_total for a route and status, from /metrics (0 when absent)."""
    _, text = http("GET", f"http://{stack.gateway.address}/metrics")
    found = re.search(rf'^specdec_gateway_requests_total{{route="{route}",status="{status}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_caller_gone_before_its_body_came_is_counted_as_gone(stack):
    """Part of a body, then the connection closed: counted as a caller that went away (499), not a failure."""
    before = answered(stack, "chat", 499), answered(stack, "chat", 500)
    host, port = stack.gateway.address.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f'{head}Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n{{"model"'.encode())
    deadline = time.monotonic() + 30
    while answered(stack, "chat", 499) == before[0]:
        assert time.monotonic() < deadline, "the request was not counted"
        time.sleep(0.05)
    assert answered(stack, "chat", 500) == before[1]


def test_echoed_values_are_cut_short(stack):
    long_name = "x" * 100_000
    status, body = post(stack, {**CHAT, long_name: 1})
    assert status == 400 and len(json.dumps(body)) < 1024, body
    status, body = post(stack, {**CHAT, "model": "m" * 300})
    assert status == 400 and len(json.dumps(body)) < 1024, body  # longer than any model name: a bad field
    status, body = post(stack, {**CHAT, "model": "gpt-" + "\u2603" * 40})
    assert status == 404 and len(body["error"]["message"]) < 200, body


def test_a_missing_or_malformed_token_is_a_401(stack):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        status, body = http("POST", f"http://{stack.gateway.address}/v1/chat/completions", CHAT, headers)
        assert status == 401 and body["error"]["type"] == "authentication_error", body


def test_the_gateway_still_serves_after_all_that(stack):
    status, body = post(stack, CHAT)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None, body
    status, body = http("GET", f"http://{stack.gateway.address}/health")
    assert status == 200 and body["status"] == "ok", body
    status, text = http("GET", f"http://{stack.gateway.address}/metrics")
    assert status == 200 and 'specdec_gateway_requests_total{route="chat",status="400"}' in text

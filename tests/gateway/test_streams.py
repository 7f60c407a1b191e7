"""Server-sent events as curl sees them on the wire, and callers that go away: the executor's request is aborted
(its GetLoads shows nothing running, and far fewer tokens generated than the request asked for)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time

import grpc
import pytest
from gateway_stack import MODEL, TOKEN, http
from gateway_streams import LONG, NO_HANG_S, open_request

from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.auth import bearer_metadata


def loads(stack) -> executor_pb2.GetLoadsResponse:
    with grpc.insecure_channel(stack.executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        return stub.GetLoads(executor_pb2.GetLoadsRequest(), metadata=bearer_metadata(TOKEN), timeout=10)


def wait_running(stack, running: int) -> executor_pb2.GetLoadsResponse:
    deadline = time.monotonic() + NO_HANG_S
    while (now := loads(stack)).running_requests + now.queued_requests != running:
        assert time.monotonic() < deadline, f"still {now.running_requests} running:\n{stack.executor.log()[-3000:]}"
        time.sleep(0.05)
    return now


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sees_server_sent_events_ending_in_done(stack):
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    command = [
        "curl", "-sS", "-N", "-i", f"http://{stack.gateway.address}/v1/chat/completions",
        "-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json", "-d", json.dumps(body),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=NO_HANG_S, check=True)
    head, _, stream = done.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower(), head
    events = stream.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", stream[-300:]
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") and "\n" not in event for event in events[:-2])
    assert (
        payloads[0]["object"] == "chat.completion.chunk" and payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] > 0
    assert payloads[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_deadline_is_an_error_event_once_the_stream_began(stack, launch_gateway):
    """--request-timeout passes mid-stream (the tiny model's first token comes far sooner, its 4000th far later):
    the 200 is sent by then, so the error comes as an event, then [DONE]. Were the machine so slow that the
    deadline came first, the answer is the plain 504 instead; either way DEADLINE_EXCEEDED in OpenAI's shape."""
    gateway = launch_gateway(stack.executor.address, "--auth-token", TOKEN, "--request-timeout", "3")
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    status, text = http("POST", f"http://{gateway.address}/v1/completions", body, {"Authorization": f"Bearer {TOKEN}"})
    if status == 200:
        events = text.split("\n\n")
        assert events[-2] == "data: [DONE]" and json.loads(events[0].removeprefix("data: "))["choices"]
        error = json.loads(events[-3].removeprefix("data: "))["error"]
    else:
        assert status == 504, text
        error = text["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "server_error", error
    wait_running(stack, 0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_caller_that_goes_away_aborts_the_executors_request(stack, stream):
    before = wait_running(stack, 0)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    sock = open_request(stack.gateway.address, body)
    if stream:
        received = b""
        while b"data: {" not in received:  # the first event: generation is under way
            received += sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
    else:
        wait_running(stack, 1)
    sock.close()
    after = wait_running(stack, 0)
    generated = after.generation_tokens_total - before.generation_tokens_total
    assert generated < LONG, f"the request ran to its end ({generated} tokens): it was not aborted"
    status, text = http("GET", f"http://{stack.gateway.address}/metrics")
    assert status == 200 and "specdec_gateway_client_disconnects_total" in text
    assert "specdec_gateway_open_generations 0.0" in text


def test_a_caller_that_goes_away_aborts_every_choice(stack):
    """n = 3, streamed: the caller closes after the first event; the executor ends all three requests early."""
    before = wait_running(stack, 0)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True, "stream": True, "n": 3}
    sock = open_request(stack.gateway.address, body)
    received = b""
    while b"data: {" not in received:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    after = wait_running(stack, 0)
    generated = after.generation_tokens_total - before.generation_tokens_total
    assert generated < LONG, f"{generated} tokens for 3 choices of {LONG}: they were not aborted"


CONCURRENT = 32


def test_concurrent_streams_all_complete_with_the_direct_calls_tokens(stack):
    """Many streams through the gateway at once, each on its own connection: every one ends in [DONE] with the
    tokens a direct gRPC Generate of the same prompt gives (greedy), as in bench/gateway_bench.py's rounds."""
    prompts = [[1 + (7 * i + j) % 200 for j in range(6 + i % 5)] for i in range(CONCURRENT)]

    def through_gateway(prompt: list[int]) -> list[int]:
        body = {
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0,
        }  # fmt: skip
        status, text = http(
            "POST", f"http://{stack.gateway.address}/v1/completions", body, {"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 200, text
        events = text.split("\n\n")
        assert events[-2] == "data: [DONE]", text[-300:]
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        names = [name for chunk in chunks for name in chunk["choices"][0]["logprobs"]["tokens"]]
        return [int(name.removeprefix("token_id:")) for name in names]

    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        got = list(pool.map(through_gateway, prompts))
    with grpc.insecure_channel(stack.executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        expected = []
        for index, prompt in enumerate(prompts):
            request = executor_pb2.GenerateRequest(
                request_id=f"direct-{index}",
                token_ids=executor_pb2.TokenIds(ids=prompt),
                sampling=executor_pb2.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0),
            )
            messages = stub.Generate(request, metadata=bearer_metadata(TOKEN), timeout=NO_HANG_S)
            expected.append([entry.token_id for message in messages for entry in message.logprobs])
    assert all(len(tokens) == 24 for tokens in expected)
    assert got == expected

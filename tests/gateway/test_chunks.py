"""The streamed chunks, rendered from a per-request template (gateway_service.responses.Shaper.chunk), read
exactly as json.dumps of the chunk object: ids, model and creation time fixed per stream, the delta's text
escaped as JSON, log probabilities one entry per token when one message carries several tokens (a speculative
step's); and the body of a stream (Generation.stream): a chunk per message, each message read once the chunk
before it is sent, the last chunk, the usage chunk and [DONE] in the last body message. In-process, no servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from gateway_fakes import FakeCall, Sent, events, message, payload
from grpc.aio import Metadata

from gateway_service import responses
from gateway_service.errors import ApiError
from gateway_service.generation import DONE, Generation
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import parse_chat, parse_completion
from gateway_service.responses import Shaper, encode
from specdec.v1 import executor_pb2


def expected(shaper: Shaper, text: str, logprobs: Any, reason: str | None, first: bool) -> bytes:
    """The chunk as the gateway built it before the template: a dict through json.dumps."""
    choice: dict[str, Any] = {"index": 0}
    if shaper.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = reason
    kind = "chat.completion.chunk" if shaper.chat else "text_completion"
    chunk = {"id": shaper.parsed.generate.request_id, "object": kind, "created": shaper.created}
    chunk.update(model=shaper.model, choices=[choice])
    if shaper.parsed.include_usage:
        chunk["usage"] = None
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


TEXTS = ["plain", 'quote " backslash \\ newline \n tab \t', "é ü 日本 \U0001f600", "</script>\x00\x1f"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_chunks_read_as_json_dumps_of_the_chunk(include_usage, logprobs):
    body: dict[str, Any] = {"model": 'm"odel', "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body.update(stream_options={"include_usage": include_usage}, logprobs=logprobs)
    shaper = Shaper(parse_chat(body), 'm"odel\u00e9')
    for index, text in enumerate(TEXTS):
        first, reason = index == 0, "length" if index == len(TEXTS) - 1 else None
        got = shaper.chunk(message(text, [(7, -0.25)], reason), first)
        entry = {"token": "token_id:7", "logprob": -0.25, "bytes": None}
        top = {"content": [{**entry, "top_logprobs": [{"token": "token_id:8", "logprob": -1.25, "bytes": None}]}]}
        assert got == expected(shaper, text, top if logprobs else None, reason, first)


@pytest.mark.parametrize("logprobs", [None, 0, 2])
def test_completion_chunks_read_as_json_dumps_of_the_chunk(logprobs):
    body: dict[str, Any] = {"prompt": "x", "stream": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    shaper = Shaper(parse_completion(body), "bench")
    for text in TEXTS:
        got = shaper.chunk(message(text, [(3, -0.5)], "stop"), True)
        lp = {"tokens": ["token_id:3"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:4": -1.5}]}
        assert got == expected(shaper, text, None if logprobs is None else {**lp, "text_offset": None}, "stop", True)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_message_of_several_tokens_is_one_chunk_one_logprob_per_token(kind):
    """A speculative step's message: its text (the executor's, for every token) in one delta, the log
    probabilities one entry per token in order, as json.dumps writes them."""
    tokens = [(1, -0.5), (2, -1.0), (3, -2.0)]
    if kind == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True}
        shaper = Shaper(parse_chat({**body, "top_logprobs": 1}), "bench")
        logprobs: Any = {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                 "top_logprobs": [{"token": f"token_id:{t + 1}", "logprob": lp - 1, "bytes": None}]}
                for t, lp in tokens
            ]
        }  # fmt: skip
    else:
        shaper = Shaper(parse_completion({"prompt": "x", "stream": True, "logprobs": 1}), "bench")
        logprobs = {
            "tokens": [f"token_id:{t}" for t, _ in tokens],
            "token_logprobs": [lp for _, lp in tokens],
            "top_logprobs": [{f"token_id:{t + 1}": lp - 1} for t, lp in tokens],
            "text_offset": None,
        }
    got = shaper.chunk(message("a b\nc", tokens, "length"), False)
    assert got == expected(shaper, "a b\nc", logprobs, "length", False)
    choice = json.loads(got.removeprefix(b"data: "))["choices"][0]
    assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == "a b\nc"


LOGPROBS = [0.0, -0.0, -1e-45, -0.1, -2.3456789012345678, -1e300, float("-inf"), float("inf"), float("nan")]


def test_log_probabilities_written_directly_read_as_the_encoder_writes_them():
    """chat_logprobs_json / completion_logprobs_json against encode of the dicts the whole answer uses: floats as
    float32 holds them (repr), NaN and the infinities as json.dumps writes them, no entry, no top entries, and a
    token named twice among a token's top entries (one key of the completion's object, the last value)."""
    response = executor_pb2.GenerateResponse()
    for index, logprob in enumerate(LOGPROBS):
        entry = response.logprobs.add(token_id=index * 1000, logprob=logprob)
        for top in range(index % 3):
            entry.top_logprobs.add(token_id=7, logprob=logprob - top)  # 7 twice when index % 3 == 2
    singles = [[entry] for entry in response.logprobs]  # one token a step: each value, with and without tops
    for entries in (response.logprobs, [], [response.logprobs[0], response.logprobs[2]], *singles):
        assert responses.chat_logprobs_json(entries) == encode(responses.chat_logprobs(list(entries)))
        assert responses.completion_logprobs_json(entries) == encode(responses.completion_logprobs(list(entries)))


def test_an_aborted_finish_is_an_error_not_a_chunk():
    shaper = Shaper(parse_completion({"prompt": "x", "stream": True}), "bench")
    with pytest.raises(ApiError) as raised:
        shaper.chunk(message("a", [(1, -0.5)], "abort"), True)
    assert raised.value.status == 503


def generation(call: FakeCall, **body: Any) -> Generation:
    parsed = parse_completion({"prompt": "x", "stream": True, "logprobs": 0, **body})
    return Generation(call, parsed, Shaper(parsed, "bench"), GatewayMetrics(), "completion", 0.0)  # type: ignore[arg-type]


def test_a_chunk_per_message_each_read_once_the_one_before_is_sent():
    async def run() -> None:
        call, sent = FakeCall(), Sent()
        stream = asyncio.ensure_future(generation(call).stream(message("a", [(1, -0.5)]), sent))
        first, more = await sent.next()  # nothing else has come: sent alone, at once
        assert more and payload(first)["choices"][0]["text"] == "a"
        await asyncio.sleep(0.01)
        assert call.reads == 1 and not sent.bodies[1:]  # the next read waits for the executor
        for text, token in (("b", 2), ("c", 3)):  # two came at once: a chunk each, read one after the other
            call.queue.put_nowait(message(text, [(token, -1.0)]))
        assert [payload((await sent.next())[0])["choices"][0]["text"] for _ in range(2)] == ["b", "c"]
        sent.open.clear()  # the caller stops reading: the next chunk's send waits, and nothing more is read
        call.queue.put_nowait(message("c2", [(9, -1.0)]))
        assert payload((await sent.next())[0])["choices"][0]["text"] == "c2"
        await asyncio.sleep(0.01)
        assert call.reads == 3
        sent.open.set()
        call.queue.put_nowait(message("d", [(4, -2.0), (5, -3.0)], "length"))
        last, more = await sent.next()
        assert not more and events(last)[1:] == [DONE]  # the last chunk and [DONE]: the body's last message
        choice = payload(events(last)[0])["choices"][0]
        assert choice["text"] == "d" and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == ["token_id:4", "token_id:5"]
        await stream
        assert not call.cancelled and call.reads == 4  # it ended: nothing to abort

    asyncio.run(run())


def test_the_usage_chunk_goes_with_the_last_chunk_and_done():
    async def run() -> None:
        call, sent = FakeCall(), Sent()
        last = message("a", [(1, -0.5)], "stop")
        last.finished.prompt_tokens, last.finished.completion_tokens = 3, 1
        await generation(call, stream_options={"include_usage": True}).stream(last, sent)
        assert len(sent.bodies) == 1 and not sent.bodies[0][1]
        chunk, usage, done = events(sent.bodies[0][0])
        assert payload(chunk)["choices"][0]["finish_reason"] == "stop" and payload(chunk)["usage"] is None
        assert payload(usage)["choices"] == [] and payload(usage)["usage"]["total_tokens"] == 4 and done == DONE

    asyncio.run(run())


def test_a_stream_cancelled_early_cancels_the_call():
    async def run() -> None:
        call, sent = FakeCall(), Sent()
        stream = asyncio.ensure_future(generation(call).stream(message("a", [(1, -0.5)]), sent))
        await sent.next()
        await asyncio.sleep(0.01)  # waiting for the next message
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        assert call.cancelled

    asyncio.run(run())


def test_a_caller_gone_ends_the_body_without_done():
    async def run() -> None:
        call, sent = FakeCall(), Sent()
        made = generation(call)
        stream = asyncio.ensure_future(made.stream(message("a", [(1, -0.5)]), sent))
        await sent.next()
        await asyncio.sleep(0.01)
        made.caller_gone()  # the disconnect watcher's doing: the call is cancelled under the waiting read
        await stream
        assert call.cancelled and sent.bodies[-1] == (b"", False)

    asyncio.run(run())


def test_an_error_after_the_first_chunk_is_an_error_event_then_done():
    async def run() -> None:
        for failure, code in (
            (message("b", [(2, -0.5)], "abort"), "aborted"),  # the executor shut down mid-stream
            (grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), "gone"), "unavailable"),
            (grpc.aio.EOF, None),  # the stream ended without its final message: [DONE] all the same
        ):
            call, sent = FakeCall(), Sent()
            stream = asyncio.ensure_future(generation(call).stream(message("a", [(1, -0.5)]), sent))
            await sent.next()
            call.queue.put_nowait(failure)
            body, more = await sent.next()
            await stream
            if code is None:
                assert body == DONE and not more
                continue
            error, done = events(body)
            assert payload(error)["error"]["code"] == code and done == DONE and not more

    asyncio.run(run())


def test_the_event_streams_headers_are_what_starlette_writes_for_them():
    """EventStream sends its headers as written once; they are what starlette's Response made of them (its
    StreamingResponse before: no content-length, the media type with starlette's charset)."""
    from starlette.responses import StreamingResponse

    from gateway_service.app import EVENT_STREAM_HEADERS

    streamed = StreamingResponse(iter(()), media_type="text/event-stream")
    streamed.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    assert list(EVENT_STREAM_HEADERS) == streamed.raw_headers

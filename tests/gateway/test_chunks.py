"""The streamed chunks, rendered from a per-request template (gateway_service.responses.Shaper.chunk), read
exactly as json.dumps of the chunk object: ids, model and creation time fixed per stream, the delta's text
escaped as JSON, log probabilities one entry per token when several messages share one chunk; and the events of a
stream (Generation.events): messages that came while a chunk was sent share the next one, none waits to be
batched. In-process, no servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway_service.errors import ApiError
from gateway_service.generation import DONE, Generation
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import parse_chat, parse_completion
from gateway_service.responses import Shaper
from specdec.v1 import executor_pb2


def message(text: str, tokens: list[tuple[int, float]], reason: str | None = None) -> executor_pb2.GenerateResponse:
    response = executor_pb2.GenerateResponse(request_id="r", text=text, token_ids=[t for t, _ in tokens])
    for token, logprob in tokens:
        entry = response.logprobs.add(token_id=token, logprob=logprob)
        entry.top_logprobs.add(token_id=token + 1, logprob=logprob - 1)
    if reason is not None:
        response.finished.finish_reason = reason
    return response


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
        got = shaper.chunk([message(text, [(7, -0.25)], reason)], first)
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
        got = shaper.chunk([message(text, [(3, -0.5)], "stop")], True)
        lp = {"tokens": ["token_id:3"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:4": -1.5}]}
        assert got == expected(shaper, text, None if logprobs is None else {**lp, "text_offset": None}, "stop", True)


def test_consecutive_messages_share_a_chunk_one_logprob_per_token():
    shaper = Shaper(parse_completion({"prompt": "x", "stream": True, "logprobs": 0}), "bench")
    messages = [message("a", [(1, -0.5), (2, -1.0)]), message("b", [(3, -2.0)]), message("c", [(4, -3.0)], "length")]
    chunk = json.loads(shaper.chunk(messages, False).removeprefix(b"data: "))
    choice = chunk["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["token_id:1", "token_id:2", "token_id:3", "token_id:4"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0, -2.0, -3.0]


def test_an_aborted_finish_is_an_error_not_a_chunk():
    shaper = Shaper(parse_completion({"prompt": "x", "stream": True}), "bench")
    with pytest.raises(ApiError) as raised:
        shaper.chunk([message("a", [(1, -0.5)], "abort")], True)
    assert raised.value.status == 503


class FakeCall:
    """A Generate call whose messages the test hands over one by one (grpc.aio's read(), done(), cancel())."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.reads = 0
        self.cancelled = False

    async def read(self) -> Any:
        self.reads += 1
        return await self.queue.get()

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def generation(call: FakeCall) -> Generation:
    parsed = parse_completion({"prompt": "x", "stream": True, "logprobs": 0})
    return Generation(call, parsed, Shaper(parsed, "bench"), GatewayMetrics(), "completion", 0.0)  # type: ignore[arg-type]


def payload(event: bytes) -> dict[str, Any]:
    return json.loads(event.removeprefix(b"data: "))


def test_messages_that_came_while_a_chunk_was_sent_share_the_next_chunk():
    async def run() -> None:
        call = FakeCall()
        events = generation(call).events(message("a", [(1, -0.5)]))
        first = await anext(events)  # nothing else has come: sent alone, at once
        assert payload(first)["choices"][0]["text"] == "a"
        for text, token in (("b", 2), ("c", 3)):  # the caller was slow: two more came meanwhile
            call.queue.put_nowait(message(text, [(token, -1.0)]))
        await asyncio.sleep(0.01)
        merged = payload(await anext(events))["choices"][0]
        assert merged["text"] == "bc" and merged["logprobs"]["tokens"] == ["token_id:2", "token_id:3"]
        waiting = asyncio.ensure_future(anext(events))  # nothing ready: the next chunk waits for the next message
        await asyncio.sleep(0.01)
        assert not waiting.done()
        call.queue.put_nowait(message("d", [(4, -2.0)], "length"))
        last = payload(await waiting)["choices"][0]
        assert last["text"] == "d" and last["finish_reason"] == "length"
        assert await anext(events) == DONE
        assert not call.cancelled  # it ended: nothing to abort

    asyncio.run(run())


def test_a_stream_closed_early_cancels_the_call():
    async def run() -> None:
        call = FakeCall()
        events = generation(call).events(message("a", [(1, -0.5)]))
        await anext(events)
        await asyncio.sleep(0.01)  # the reader waits for the next message
        await events.aclose()  # type: ignore[attr-defined]
        assert call.cancelled

    asyncio.run(run())


def test_an_error_after_the_first_chunk_is_an_error_event_then_done():
    async def run() -> None:
        call = FakeCall()
        events = generation(call).events(message("a", [(1, -0.5)]))
        await anext(events)
        call.queue.put_nowait(message("b", [(2, -0.5)], "abort"))  # the executor shut down mid-stream
        error = payload(await anext(events))["error"]
        assert error["code"] == "aborted" and await anext(events) == DONE

    asyncio.run(run())

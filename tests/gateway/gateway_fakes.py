"""Stand-ins for the gateway's in-process tests: executor messages, a Generate call the test feeds, and the ASGI
send of a stream's body (tests/gateway/test_chunks.py, test_choices.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from specdec.v1 import executor_pb2


def message(text: str, tokens: list[tuple[int, float]], reason: str | None = None) -> executor_pb2.GenerateResponse:
    response = executor_pb2.GenerateResponse(request_id="r", text=text, token_ids=[t for t, _ in tokens])
    for token, logprob in tokens:
        entry = response.logprobs.add(token_id=token, logprob=logprob)
        entry.top_logprobs.add(token_id=token + 1, logprob=logprob - 1)
    if reason is not None:
        response.finished.finish_reason = reason
    return response


class FakeCall:
    """A Generate call whose messages the test hands over one by one (grpc.aio's read(), done(), cancel(): a
    cancelled call's pending read raises CancelledError, as grpc.aio's does)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.reads = 0
        self.cancelled = False
        self.pending: asyncio.Future[Any] | None = None

    async def read(self) -> Any:
        self.reads += 1
        if self.cancelled:
            raise asyncio.CancelledError
        self.pending = asyncio.ensure_future(self.queue.get())
        item = await self.pending
        if isinstance(item, BaseException):
            raise item
        return item

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        if self.pending is not None:
            self.pending.cancel()
        return True


class Sent:
    """The ASGI body messages of a stream, as a server's send gets them (each message's body copied: the stream
    reuses one dict), and whether the stream is waiting for a send."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bool]] = []
        self.changed = asyncio.Event()
        self.open = asyncio.Event()  # cleared: a send waits (a caller reading slowly)
        self.open.set()

    async def __call__(self, message: dict[str, Any]) -> None:
        assert message["type"] == "http.response.body"
        self.bodies.append((bytes(message["body"]), message["more_body"]))
        self.changed.set()
        await self.open.wait()

    async def next(self) -> tuple[bytes, bool]:
        while len(self.bodies) <= self.seen:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)
        self.seen += 1
        return self.bodies[self.seen - 1]

    seen = 0


def payload(event: bytes) -> dict[str, Any]:
    return json.loads(event.removeprefix(b"data: "))


def events(body: bytes) -> list[bytes]:
    *parts, rest = body.split(b"\n\n")
    assert rest == b""
    return [part + b"\n\n" for part in parts]

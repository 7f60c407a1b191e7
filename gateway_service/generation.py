"""One generation through the executors: its first message awaited before the HTTP status is chosen (so that a
refused request gets its 4xx, not a 200 with an error inside), then either collected whole or streamed as
server-sent events ending in `data: [DONE]`.

Nothing generates for nobody: when the caller goes away (the HTTP connection closes) while the gateway waits for
the executor, the gRPC call is cancelled, and the executor aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.types import Receive

from gateway_service.errors import ApiError, from_rpc_error
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import ParsedRequest
from gateway_service.responses import Shaper, encode
from specdec.v1 import executor_pb2

log = logging.getLogger("specdec.gateway")
DONE = b"data: [DONE]\n\n"


class Disconnected(Exception):
    """The caller closed the connection before the answer was ready."""


def watch_disconnect(receive: Receive, generation: Generation) -> asyncio.Task[None]:
    """A task that cancels `generation` (its gRPC call, hence the executor's request) when the caller goes away;
    cancel it once the answer is sent. One per request, started once the body is read (the next ASGI message is
    then the disconnect), for the wait for the first message and the whole answer or stream after it."""
    watcher = asyncio.ensure_future(_disconnect(receive))
    watcher.add_done_callback(lambda task: task.cancelled() or task.exception() or generation.caller_gone())
    return watcher


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class Generation:
    """The gRPC call of one request, with what it needs to answer in OpenAI's shapes."""

    call: grpc.aio.UnaryStreamCall
    parsed: ParsedRequest
    shaper: Shaper
    metrics: GatewayMetrics
    route: str
    started: float
    ended: bool = False  # the final message (or an error) has come: nothing left to abort
    gone: bool = False  # the caller went away: the call is cancelled, reading it raises Disconnected

    async def read(self) -> executor_pb2.GenerateResponse | None:
        """The next message (None at the end); an executor's error as ApiError, the caller gone as Disconnected."""
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError as err:
            self.ended = True
            raise from_rpc_error(err, self.parsed.param_for) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.gone and not (task is not None and task.cancelling()):  # the call's, not this task's
                raise Disconnected from None
            raise
        if message is grpc.aio.EOF:
            self.ended = True
            return None
        self.ended = message.HasField("finished")
        return message

    async def first(self) -> executor_pb2.GenerateResponse:
        message = await self.read()
        if message is None:
            raise ApiError(502, "the executor ended the stream without an answer", code="bad_gateway")
        self.metrics.first_token_after(self.route, time.perf_counter() - self.started)
        return message

    def caller_gone(self) -> None:
        self.gone = True
        self.cancel()

    def cancel(self) -> None:
        """Abort the executor's request (nothing if it has ended)."""
        if not self.ended and not self.call.done():
            self.call.cancel()
            self.metrics.disconnects.inc()
            log.info("caller went away: request aborted", extra={"request_id": self.parsed.generate.request_id})

    def _finished(self, finished: executor_pb2.Finished) -> None:
        self.metrics.prompt_tokens.inc(finished.prompt_tokens)
        self.metrics.completion_tokens.inc(finished.completion_tokens)

    async def whole(self, first: executor_pb2.GenerateResponse) -> dict[str, Any]:
        """The non-streamed answer: every message's text and log probabilities joined."""
        texts, entries, message = [], [], first
        while True:
            texts.append(message.text)
            entries.extend(message.logprobs)
            if message.HasField("finished"):
                self._finished(message.finished)
                return self.shaper.whole("".join(texts), entries, message.finished)
            following = await self.read()
            if following is None:
                raise ApiError(502, "the executor's stream ended without its final message", code="bad_gateway")
            message = following

    async def events(self, first: executor_pb2.GenerateResponse) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per message, the usage chunk if asked for, then [DONE]. An error after the
        first chunk (the status is sent by then) is an `error` object in the stream, as vLLM and OpenAI do. The
        caller gone: the events just end (there is nobody to send [DONE] to).

        Messages that came while the last chunk was being sent (a caller reading slower than the executor
        writes) go out as one chunk: their text joined, their log probabilities one entry per token, in order.
        Nothing waits to be batched: a message that finds the sender idle is sent at once."""
        try:
            async for messages in self._ready(first):
                last = messages[-1]
                yield self.shaper.chunk(messages, messages[0] is first)
                if last.HasField("finished"):
                    self._finished(last.finished)
                    if self.parsed.include_usage:
                        yield _event(self.shaper.usage_chunk(last.finished))
                    break
        except ApiError as err:
            yield _event(err.body())
        except Disconnected:
            return
        finally:
            self.cancel()  # the caller went away (this generator was closed early), or the stream broke
        yield DONE

    async def _ready(self, first: executor_pb2.GenerateResponse) -> AsyncIterator[list[executor_pb2.GenerateResponse]]:
        """The messages in order, in lists of those already read when the consumer asks: a reader task keeps
        one read in flight while the consumer sends, so that what piled up meanwhile comes as one list."""
        loop = asyncio.get_running_loop()
        ready: list[Any] = [first]  # messages, then None at the end or the exception that ended the reading
        waiting: list[asyncio.Future[None]] = []

        async def reader() -> None:
            try:
                while True:
                    message = await self.read()
                    ready.append(message)
                    if waiting and not waiting[0].done():
                        waiting[0].set_result(None)
                    if message is None or message.HasField("finished"):
                        return
            except BaseException as err:  # ApiError, Disconnected, or anything else: the consumer raises it
                ready.append(err)
                if waiting and not waiting[0].done():
                    waiting[0].set_result(None)
                if not isinstance(err, Exception):
                    raise  # cancelled (the consumer stopped early)

        task = loop.create_task(reader()) if not first.HasField("finished") else None
        try:
            while True:
                if not ready:
                    waiting[:] = [loop.create_future()]
                    await waiting[0]
                batch, ready[:] = ready[:], []
                messages = [m for m in batch if isinstance(m, executor_pb2.GenerateResponse)]
                if messages:
                    yield messages
                if len(messages) < len(batch):
                    end = batch[len(messages)]
                    if end is None:
                        return
                    raise end
                if messages[-1].HasField("finished"):
                    return
        finally:
            if task is not None:
                task.cancel()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + encode(data).encode() + b"\n\n"

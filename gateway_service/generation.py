"""One generation through the executors: its first message awaited before the HTTP status is chosen (so that a
refused request gets its 4xx, not a 200 with an error inside), then either collected whole or streamed as
server-sent events ending in `data: [DONE]`.

Nothing generates for nobody: when the caller goes away (the HTTP connection closes) while the gateway waits for
the executor, the gRPC call is cancelled, and the executor aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from starlette.types import Receive, Send

from gateway_service.errors import ApiError, from_rpc_error
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import ParsedRequest
from gateway_service.responses import Collected, Shaper, encode
from specdec.v1 import executor_pb2

if TYPE_CHECKING:
    from gateway_service.choices import Choices

log = logging.getLogger("specdec.gateway")
DONE = b"data: [DONE]\n\n"


class Disconnected(Exception):
    """The caller closed the connection before the answer was ready."""


def watch_disconnect(receive: Receive, generation: Generation | Choices) -> asyncio.Task[None]:
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
            if self._cancelled_by_caller():
                raise Disconnected from None
            raise
        if message is grpc.aio.EOF:
            self.ended = True
            return None
        self.ended = message.HasField("finished")
        return message

    def _cancelled_by_caller(self) -> bool:
        """A CancelledError just caught is the call's (cancelled because the caller went away), not this task's."""
        task = asyncio.current_task()
        return self.gone and not (task is not None and task.cancelling())

    async def first(self, timed: bool = True) -> executor_pb2.GenerateResponse:
        """The first message; `timed`: observed as the request's time to its first token (a choice's is not:
        choices.py observes the request's)."""
        message = await self.read()
        if message is None:
            raise ApiError(502, "the executor ended the stream without an answer", code="bad_gateway")
        if timed:
            self.metrics.first_token_after(self.route, time.perf_counter() - self.started)
        return message

    def caller_gone(self) -> None:
        self.gone = True
        self.cancel()

    def cancel(self) -> None:
        """Abort the executor's request (nothing if it has ended), counted and logged."""
        if self.abort():
            self.metrics.disconnects.inc()
            log.info("caller went away: request aborted", extra={"request_id": self.parsed.generate.request_id})

    def abort(self) -> bool:
        """Cancel the gRPC call if it is live; whether it was."""
        if self.ended or self.call.done():
            return False
        self.call.cancel()
        return True

    def count_finished(self, finished: executor_pb2.Finished) -> None:
        self.metrics.prompt_tokens.inc(finished.prompt_tokens)
        self.metrics.completion_tokens.inc(finished.completion_tokens)

    async def whole(self, first: executor_pb2.GenerateResponse) -> dict[str, Any]:
        """The non-streamed answer."""
        return self.shaper.whole([await self.collect(first)])

    async def collect(self, first: executor_pb2.GenerateResponse) -> Collected:
        """Every message's text and log probabilities joined, and the final message's Finished."""
        texts, entries, message = [], [], first
        while True:
            texts.append(message.text)
            entries.extend(message.logprobs)
            if message.HasField("finished"):
                self.count_finished(message.finished)
                return "".join(texts), entries, message.finished
            following = await self.read()
            if following is None:
                raise ApiError(502, "the executor's stream ended without its final message", code="bad_gateway")
            message = following

    async def stream(self, first: executor_pb2.GenerateResponse, send: Send) -> None:
        """The body of the server-sent events, as ASGI http.response.body messages to `send`: a chunk per executor
        message (one message per engine step, with every token of that step: one delta carries their text, its log
        probabilities one entry per token), then the usage chunk if asked for and `data: [DONE]`, which go out
        with the last chunk in the last body message. An error after the first chunk (the status is sent by then)
        is an `error` object in the stream, as vLLM and OpenAI do. The caller gone: the body just ends (there is
        nobody to send [DONE] to).

        Each message is read when the last chunk has been handed to the connection, so that a caller reading
        slower than the executor writes holds the executor's stream back through gRPC's flow control, and the
        gateway buffers nothing of its own."""
        body: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": True}
        chunk, call, message, is_first, tail = self.shaper.chunk, self.call, first, True, DONE
        try:
            while True:
                if message.HasField("finished"):
                    self.ended = True
                    finished = message.finished
                    last = chunk(message, is_first)  # an aborted finish raises ApiError here
                    self.count_finished(finished)
                    if self.parsed.include_usage:
                        last += event(self.shaper.usage_chunk([finished]))
                    tail = last + DONE
                    break
                body["body"] = chunk(message, is_first)  # one dict for every event: send() is done with it
                is_first = False
                await send(body)
                message = await call.read()
                if message is grpc.aio.EOF:  # ended without its final message: [DONE] all the same
                    self.ended = True
                    break
        except grpc.aio.AioRpcError as err:
            self.ended = True
            tail = event(from_rpc_error(err, self.parsed.param_for).body()) + DONE
        except ApiError as err:
            tail = event(err.body()) + DONE
        except asyncio.CancelledError:
            if not self._cancelled_by_caller():
                raise
            tail = b""
        finally:
            self.cancel()  # the caller went away, or the stream broke
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + encode(data).encode() + b"\n\n"

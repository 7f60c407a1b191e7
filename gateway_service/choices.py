"""`n` > 1: a request's choices, each its own Generate on the executors (vLLM's parallel sampling, fanned out to
the executors instead of forked inside one engine; with prefix caching on, the later choices find the prompt's
K/V cached). Choice i is the request with id `<id>-<i>` and, where a seed is given, seed + i (vLLM's rule), so
seeded choices differ and each one reproduces alone.

They are answered as one: the HTTP status waits for every choice's first message (a refusal of any is the
request's 4xx, the others cancelled); the whole answer lists the choices in order; a stream interleaves their
chunks as they come, each with its `index`, and ends once every choice has finished. An error in any choice ends
the request (its error, the other choices cancelled); the caller going away cancels them all."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.types import Send

from gateway_service.errors import ApiError
from gateway_service.generation import DONE, Disconnected, Generation, event
from gateway_service.requests import MAX_CHOICES, ParsedRequest, set_prompt
from gateway_service.responses import Shaper
from specdec.v1 import executor_pb2

log = logging.getLogger("specdec.gateway")
MAX_FANOUT_BYTES = 64 << 20  # n copies of one request (its prompt) the gateway builds and sends, at most
INT64 = 1 << 64


def choice_requests(parsed: ParsedRequest) -> list[executor_pb2.GenerateRequest]:
    """The Generate requests of a request's choices: n per prompt (a completion may batch several), choice i of
    prompt p the request `<id>-<p * n + i>` with seed + i. Refused (400 naming `n`, or `prompt` for a batch) when
    their copies of the prompts would pass MAX_FANOUT_BYTES or MAX_CHOICES in all, before any is built."""
    generate, n, prompts = parsed.generate, parsed.n, parsed.prompts or [None]
    param = "n" if parsed.prompts is None else "prompt"
    if parsed.num_choices > MAX_CHOICES:
        message = f"{len(prompts)} prompts x n = {n} are {parsed.num_choices} choices; at most {MAX_CHOICES}"
        raise ApiError(400, message, param, "invalid_value")
    bases = []
    for prompt in prompts:
        base = executor_pb2.GenerateRequest()
        base.CopyFrom(generate)
        if prompt is not None:
            base.ClearField("input")
            set_prompt(base, prompt)
        bases.append(base)
    size = sum(base.ByteSize() for base in bases)
    if n * size > MAX_FANOUT_BYTES:
        message = f"{parsed.num_choices} choices of {size} bytes of prompts are over {MAX_FANOUT_BYTES} bytes"
        raise ApiError(400, message, param, "invalid_value")
    seeded = generate.sampling.HasField("seed")
    requests = []
    for index, base in enumerate(bases):
        for choice_index in range(n):
            choice = executor_pb2.GenerateRequest()
            choice.CopyFrom(base)
            choice.request_id = f"{generate.request_id}-{index * n + choice_index}"
            if seeded:  # wrapped into int64, as the field holds it
                choice.sampling.seed = (generate.sampling.seed + choice_index + INT64 // 2) % INT64 - INT64 // 2
            requests.append(choice)
    return requests


class Choices:
    """The Generations of one request's choices, answered as one (Generation's interface: first, whole, stream,
    cancel, caller_gone)."""

    def __init__(self, generations: list[Generation], shaper: Shaper) -> None:
        self.generations, self.shaper = generations, shaper
        self.parsed = shaper.parsed

    async def first(self) -> list[executor_pb2.GenerateResponse]:
        """Every choice's first message; the first error raised, with every choice cancelled."""
        firsts = await self._together([asyncio.ensure_future(g.first(timed=False)) for g in self.generations])
        one = self.generations[0]
        one.metrics.first_token_after(one.route, time.perf_counter() - one.started)
        return firsts

    async def whole(self, firsts: list[executor_pb2.GenerateResponse]) -> dict[str, Any]:
        tasks = [asyncio.ensure_future(g.collect(f)) for g, f in zip(self.generations, firsts, strict=True)]
        return self.shaper.whole(await self._together(tasks))

    async def _together(self, tasks: list[asyncio.Future]) -> list[Any]:
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            self.cancel()
            raise

    async def stream(self, firsts: list[executor_pb2.GenerateResponse], send: Send) -> None:
        """The server-sent events of every choice, as Generation.stream's for one: a chunk per executor message,
        sent as it comes; the last choice's last chunk goes out with the usage chunk (if asked for) and
        `data: [DONE]`. An error is the stream's last event before [DONE]; the caller gone, the body just ends."""
        try:
            tail = await self._events(firsts, send)
        except ApiError as err:
            tail = event(err.body()) + DONE
        except Disconnected:
            tail = b""
        except asyncio.CancelledError:
            if not any(g.gone for g in self.generations):
                raise
            tail = b""
        finally:
            self.cancel()  # the caller went away, or a choice broke: the others end too
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _events(self, firsts: list[executor_pb2.GenerateResponse], send: Send) -> bytes:
        """Send every chunk but the last; return the last with what follows it. One message per choice is read
        ahead at most, so a caller reading slowly holds every executor stream back (gRPC's flow control)."""
        body: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": True}
        finished: dict[int, executor_pb2.Finished] = {}
        reads: dict[asyncio.Future, int] = {}
        ready = [(index, message, True) for index, message in enumerate(firsts)]  # (choice, message, its first)
        try:
            while True:
                for index, message, first in ready:
                    chunk = self.shaper.chunk(message, first, index)  # an aborted finish raises ApiError
                    if message.HasField("finished"):
                        finished[index] = message.finished
                        self.generations[index].count_finished(message.finished)
                        if len(finished) == len(self.generations):
                            return chunk + self._usage(finished) + DONE
                    else:
                        reads[asyncio.ensure_future(self.generations[index].read())] = index
                    body["body"] = chunk
                    await send(body)
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                ready = []
                for task in sorted(done, key=reads.__getitem__):  # in choice order
                    index, message = reads.pop(task), task.result()  # raises ApiError, Disconnected
                    if message is None:
                        raise ApiError(502, "the executor's stream ended without its final message", code="bad_gateway")
                    ready.append((index, message, False))
        finally:
            for task in reads:
                task.cancel()

    def _usage(self, finished: dict[int, executor_pb2.Finished]) -> bytes:
        if not self.parsed.include_usage:
            return b""
        return event(self.shaper.usage_chunk([finished[index] for index in range(len(self.generations))]))

    def caller_gone(self) -> None:
        for generation in self.generations:
            generation.gone = True
        self.cancel()

    def cancel(self) -> None:
        """Abort every choice still live: one disconnect counted and logged for the request."""
        if any([generation.abort() for generation in self.generations]):  # a list: every one aborted
            one = self.generations[0]
            one.metrics.disconnects.inc()
            log.info("request aborted with its choices", extra={"request_id": self.parsed.generate.request_id})

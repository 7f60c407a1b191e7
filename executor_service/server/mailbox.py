"""Hand engine outputs to asyncio queues with one event-loop wakeup per batch, not one per token.

At batch 32 an engine step produces 32 outputs; waking the event loop for each (call_soon_threadsafe
writes the loop's self-pipe and takes its lock) costs the engine thread GIL time that then lands on
every step. The engine thread appends to a deque and schedules a flush only when none is pending; the
flush, on the loop, delivers everything that accumulated.
"""

from __future__ import annotations

import asyncio
import collections
import threading

from executor_service.engine.request import RequestOutput


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = collections.deque()
        self._lock = threading.Lock()
        self._flush_scheduled = False

    def post(self, queue: asyncio.Queue[RequestOutput], output: RequestOutput) -> None:
        """Called on the engine thread."""
        with self._lock:
            self._pending.append((queue, output))
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, collections.deque()
            self._flush_scheduled = False
        for queue, output in items:
            queue.put_nowait(output)

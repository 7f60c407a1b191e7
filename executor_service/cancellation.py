"""Stopping a model build part-way: SIGTERM must not wait for minutes of weight loading and warm-up.

The build runs on a thread of its own under `cancellable(event)`; the loops that take long (one tensor at a
time, one warm-up step at a time) call `check_cancelled()`, which raises LoadCancelled once the event is
set. Outside a build it does nothing, so the loaders stay usable on their own (tests, benchmarks, tools).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class LoadCancelled(BaseException):
    """The executor is shutting down: the model being built is dropped. A BaseException, as asyncio's
    CancelledError: no `except Exception` on the way (a loader turning read errors into INVALID_ARGUMENT)
    may take it for a failure of its own."""


_current = threading.local()


@contextmanager
def cancellable(event: threading.Event | None) -> Iterator[None]:
    """Within this block, on this thread, `check_cancelled()` raises once `event` is set."""
    previous = getattr(_current, "event", None)
    _current.event = event
    try:
        yield
    finally:
        _current.event = previous


def check_cancelled() -> None:
    event = getattr(_current, "event", None)
    if event is not None and event.is_set():
        raise LoadCancelled("the executor is shutting down")

"""Await a blocking call that runs on a daemon thread of its own.

asyncio.to_thread uses the loop's default executor, whose threads the interpreter joins at exit: a model
build that does not stop would keep a SIGTERM'd executor alive. A daemon thread never holds up the exit;
the call is asked to stop (its own cancel event) and is abandoned if it does not (see any_running).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_running: set[threading.Thread] = set()  # started here and not finished


def any_running() -> bool:
    """Whether a call is still running: the process must then exit with os._exit, since the interpreter's
    finalization aborts ("terminate called without an active exception") under a thread in native code."""
    return any(thread.is_alive() for thread in list(_running))


async def in_daemon_thread(name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` on a new daemon thread named `name`; its result or its exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = context.run(function, *args, **kwargs), None
        except BaseException as err:  # handed to the awaiting task, whatever it is
            result, error = None, err
        finally:
            _running.discard(threading.current_thread())
        with contextlib.suppress(RuntimeError):  # a closed loop: the process is exiting, nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    _running.add(thread)
    thread.start()
    return await future

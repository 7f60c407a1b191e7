"""The engine's thread and mailbox: continuous batching runs on a thread of its own.

Callers (the asyncio gRPC servicer, tests, benchmarks) only `add` requests and `abort` them; both are
thread-safe and never wait on the device. The engine thread drains those commands between steps, runs `step()`
while there is work (engine.py) and sleeps when there is none.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from executor_service.engine.request import Request
from executor_service.engine.scheduler import Scheduler


class EngineLoop:
    """The thread shell around a step: commands in, steps while there is work. Engine supplies `step`,
    `_abort` and `_flush_outbox`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}  # every request not yet finished, by id
        self._thread: threading.Thread | None = None

    def step(self) -> None:
        raise NotImplementedError

    def _abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _flush_outbox(self) -> None:
        raise NotImplementedError

    def _steps_pending(self) -> bool:
        """Work the scheduler does not see (a device step launched and not yet booked)."""
        return False

    # ---- called from any thread -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Abort whatever is still live (its sinks get finish "abort"), then stop the thread."""
        self.abort(self.live_ids())
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def add(self, request: Request) -> None:
        """Queue a request the caller has checked (validation.py); KeyError if its id is live."""
        with self._lock:
            if request.request_id in self._live:
                raise KeyError(request.request_id)
            self._live[request.request_id] = request
        self._submit(lambda: self.scheduler.add(request))

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Stop these requests (finish "abort"); returns the ids that were still live."""
        with self._lock:
            found = [rid for rid in request_ids if rid in self._live]
        if found:
            self._submit(lambda: self._abort(found))
        return found

    def run_until_idle(self, before_step: Callable[[int], None] | None = None) -> None:
        """Step on the caller's thread until no work is left; only before start() (warm-up, tests).
        `before_step(n)` runs before the n-th step (from 0) and may raise to stop: the warm-up's step bound
        and its cancellation at shutdown."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is running")
        self._drain_commands()
        steps = 0
        while self._has_work():
            if before_step is not None:
                before_step(steps)
            steps += 1
            self.step()
            self._drain_commands()
        self._flush_outbox()

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- the engine thread -------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_commands()
            if self._has_work():
                self.step()
            else:
                self._flush_outbox()
                self._wake.wait()
        self._drain_commands()
        self._flush_outbox()

    def _has_work(self) -> bool:
        return self.scheduler.has_work() or self._steps_pending()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

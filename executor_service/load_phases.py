"""What a model build is doing, in the executor's log: one line as each phase starts ("load phase: warming up")
and one with the seconds each took ("load phases: ..."), so a slow load says where its time goes (specdec demo
shows the current phase beside its spinner and prints the summary)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("specdec.executor")
PHASE_PREFIX = "load phase: "
SUMMARY_PREFIX = "load phases: "


class LoadPhases:
    """Times consecutive phases of one build; `enter` ends the phase before it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._started = time.perf_counter()

    def enter(self, name: str) -> None:
        self._close()
        self._current, self._started = name, time.perf_counter()
        log.info("%s%s", PHASE_PREFIX, name)

    def finish(self) -> str:
        """Ends the last phase and logs the summary, which it returns: `name 1.2 s, ...` in build order."""
        self._close()
        summary = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        log.info("%s%s", SUMMARY_PREFIX, summary)
        return summary

    def _close(self) -> None:
        if self._current is not None:
            elapsed = time.perf_counter() - self._started
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + elapsed
            self._current = None

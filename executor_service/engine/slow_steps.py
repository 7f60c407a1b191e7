"""Steps slower than a threshold, logged with what happened in them: a diagnosis of stalls.

Adaptive speculation on the H200 priced k = 0 at 81-282 ms at small batch buckets where such a step takes ~1 ms, and
whole benchmark rounds ran 3-7x slower. This log found why (2026-11-29): each flush of held drafter context
compiled the paged-attention kernel for a new specialisation (0.8-1.2 s), and k = 0 steps at a new bucket captured a
sampler graph (0.25-0.65 s). With `SPECDEC_SLOW_STEP_MS` set, each engine step
slower than it logs one line: its time, the batch, the k planned, and every counter that moved during it (the
engine's step kinds, the device step's variants and replays, the held context's flushes, the sampler graphs
captured, and Triton's kernels compiled, by name: a hook on its in-memory cache misses). Off (unset), the engine
does nothing more per step.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable

from executor_service.engine.one_time_work import TRITON_COMPILES, watch_triton_compiles

log = logging.getLogger("specdec.executor")

Counters = Callable[[], Counter[str]]


class SlowSteps:
    """Snapshots the named counters before a step and logs those that moved when the step was slow."""

    def __init__(self, threshold_s: float, sources: dict[str, Counters]) -> None:
        self.threshold_s, self.sources = threshold_s, sources
        self.before: dict[str, Counter[str]] = {}
        self.logged = 0

    @classmethod
    def from_env(cls, sources: dict[str, Counters]) -> SlowSteps | None:
        value = os.environ.get("SPECDEC_SLOW_STEP_MS", "")
        try:
            threshold_ms = float(value)
        except ValueError:
            return None
        if threshold_ms <= 0:
            return None
        watch_triton_compiles()
        return cls(threshold_ms / 1e3, {**sources, "triton": lambda: TRITON_COMPILES})

    def start(self) -> None:
        self.before = {name: Counter(read()) for name, read in self.sources.items()}

    def finish(self, seconds: float, batch: int, planned: int | None) -> None:
        if seconds < self.threshold_s:
            return
        moved = []
        for name, read in self.sources.items():
            delta = Counter(read())
            delta.subtract(self.before.get(name, Counter()))
            moved += [f"{name}.{key}+{count}" for key, count in sorted(delta.items()) if count]
        self.logged += 1
        log.warning("slow step: %.1f ms, batch %d, k planned %s: %s", seconds * 1e3, batch, planned, " ".join(moved))

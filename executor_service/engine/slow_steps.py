"""Steps slower than a threshold, logged with what happened in them: a diagnosis of stalls.

Adaptive speculation on the H200 priced k = 0 at 81-282 ms at small batch buckets where such a step takes ~1 ms, and
whole benchmark rounds ran 5-7x slower: something in those steps stalls (a graph captured on first use, a kernel
compiled for a new shape, a flush of held drafter context). With `SPECDEC_SLOW_STEP_MS` set, each engine step
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
        return cls(threshold_ms / 1e3, {**sources, "triton": count_triton_compiles()})

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


TRITON_COMPILES: Counter[str] = Counter()  # kernel name -> compiles since the hook was installed


def count_triton_compiles() -> Counters:
    """Install (once) a hook on Triton's in-memory cache misses that counts each kernel compiled (or loaded from
    the disk cache) by name; another hook already set is still called. Triton without the hook: nothing counted."""
    try:
        from triton import knobs
    except ImportError:
        return lambda: TRITON_COMPILES
    runtime = knobs.runtime
    previous = getattr(runtime, "jit_cache_hook", None)
    if getattr(previous, "counts_compiles", False):
        return lambda: TRITON_COMPILES

    def hook(*args: object, **kwargs: object) -> bool | None:
        info = kwargs.get("fn")
        TRITON_COMPILES[str(getattr(info, "name", "kernel"))] += 1
        return previous(*args, **kwargs) if previous is not None else None

    hook.counts_compiles = True  # type: ignore[attr-defined]
    runtime.jit_cache_hook = hook
    return lambda: TRITON_COMPILES

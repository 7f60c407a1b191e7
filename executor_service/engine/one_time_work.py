"""Work a process does once per shape: Triton kernels compiled for a new specialisation. A step that does it takes
hundreds of milliseconds to seconds on a GPU (H200: 0.8-1.2 s for the paged-attention kernel), so it is no sample
of what such a step costs: adaptive speculation leaves it out of its prices (engine.py, `_price`) and slow steps
report it (slow_steps.py)."""

from __future__ import annotations

from collections import Counter

TRITON_COMPILES: Counter[str] = Counter()  # kernel name -> compiles since the hook was installed


def compiles() -> int:
    """Kernels compiled so far (0 until `watch_triton_compiles`)."""
    return TRITON_COMPILES.total()


def watch_triton_compiles() -> None:
    """Install (once) a hook on Triton's in-memory cache misses that counts each kernel compiled (or loaded from its
    disk cache) by name; a hook set before is still called. A Triton without the hook: nothing is counted."""
    try:
        from triton import knobs
    except ImportError:
        return
    runtime = knobs.runtime
    previous = getattr(runtime, "jit_cache_hook", None)
    if getattr(previous, "counts_compiles", False):
        return

    def hook(*args: object, **kwargs: object) -> bool | None:
        info = kwargs.get("fn")
        TRITON_COMPILES[str(getattr(info, "name", "kernel"))] += 1
        return previous(*args, **kwargs) if previous is not None else None

    hook.counts_compiles = True  # type: ignore[attr-defined]
    runtime.jit_cache_hook = hook

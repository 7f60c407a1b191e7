"""Counting the ops a device step dispatches (the op-count guards), its passes left out where asked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the dispatched ops that `counts` selects, except inside functions wrapped by `paused` (the target's
    and drafter's passes, when only the step's own work is measured)."""

    def __init__(self, counts: Callable[[Any], bool]) -> None:
        super().__init__()
        self.counts, self.count, self.is_paused = counts, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not self.is_paused and self.counts(func)
        return func(*args, **(kwargs or {}))

    def paused(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.is_paused = True
            try:
                return function(*args, **kwargs)
            finally:
                self.is_paused = False

        return run


def count_each_call(mode: OpCounter, owner: Any, name: str = "forward") -> list[int]:
    """Wraps `owner.name` so that each call counts its ops under `mode`: the list fills as it is called."""
    function, counts = getattr(owner, name), []

    def counted(*args: Any, **kwargs: Any) -> Any:
        start = mode.count
        with mode:
            out = function(*args, **kwargs)
        counts.append(mode.count - start)
        return out

    setattr(owner, name, counted)
    return counts

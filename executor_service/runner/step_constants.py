"""Constant index tensors of the device-resident steps (aranges, per-depth bit patterns, query starts), built
once per shape and device instead of once per step: inside a captured step every `arange` is a kernel of
each replay, and at batch 1 a step is bound by its number of small kernels, not by their work.

Values are built eagerly (StepGraphs runs each bucket eagerly before it captures it, so the graphs find them
here); one first asked for during a capture is built into that capture and not kept (its memory is the
graph pool's). Callers never write into a constant.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class StepConstants:
    """A cache of constant tensors, by key (the key names the shape, e.g. ("arange", n))."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._values: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        value = self._values.get(key)
        if value is None:
            value = build()
            if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._values[key] = value
        return value

    def arange(self, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """0, 1, ..., n - 1."""
        return self.get(("arange", n, dtype), lambda: torch.arange(n, dtype=dtype, device=self.device))

    def starts(self, count: int, width: int) -> torch.Tensor:
        """int32 query_start_loc of `count` requests of `width` queries each: 0, width, ..., count * width."""
        return self.get(
            ("starts", count, width), lambda: torch.arange(count + 1, dtype=torch.int32, device=self.device) * width
        )

    def strided(self, count: int, stride: int) -> torch.Tensor:
        """int64 0, stride, ..., (count - 1) * stride: each request's first row of a flat [count * stride]."""
        return self.get(("strided", count, stride), lambda: torch.arange(count, device=self.device) * stride)

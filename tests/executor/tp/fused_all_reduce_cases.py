"""Shapes, inputs and the launcher of the fused all-reduce's interpreter tests (test_fused_all_reduce.py and its
rank processes, fused_all_reduce_run.py)."""

from __future__ import annotations

import torch

from executor_service.parallel import fused_all_reduce
from executor_service.parallel.fused_all_reduce import SLICES

ROWS, WIDTH, EPS = 3, 40, 1e-6
SECTION = ROWS * WIDTH  # one rank's rows in a slice
NUMEL = SLICES * SECTION  # one rank's buffer (flags)
FLAGS = ROWS  # flags per peer
CALLS = (0, 1, 2, 1, 2)  # a pass's slices: its first call, then alternating


def buffer_numel(world: int, push: bool) -> int:
    """One rank's buffer: a slice holds every rank's section when pushed."""
    return NUMEL * (world if push else 1)


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, buffers: list[torch.Tensor],
    flags: list[torch.Tensor], rank: int, world: int, slot: int, push: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel as FusedAllReduceNorm launches it, over `buffers` and `flags` mapped in this process."""
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.uint64)
    offset = slot * (world if push else 1) * SECTION
    return fused_all_reduce.launch(
        x, residual, weight, EPS, buffer_ptrs.data_ptr(), flag_ptrs.data_ptr(), offset, rank, world,
        SECTION if push else 0,
    )  # fmt: skip


def inputs(rank: int, call: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """(rank's partial, residual, norm weight) of a call; the residual and weight are the same on every rank. Each
    partial holds a -0.0 (the pushed buffers' empty mark: the kernel must not send it as it is)."""
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * call + rank))
    x[0, call % WIDTH] = -0.0
    shared = torch.Generator().manual_seed(7 + call)
    residual, weight = torch.randn(ROWS, WIDTH, generator=shared), torch.rand(WIDTH, generator=shared)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)

"""Shapes, inputs and the launcher of the fused all-reduce's interpreter tests (test_fused_all_reduce.py and its
rank processes, fused_all_reduce_run.py)."""

from __future__ import annotations

import torch

from executor_service.parallel import fused_all_reduce
from executor_service.parallel.fused_all_reduce import SLICES

ROWS, WIDTH, EPS = 3, 40, 1e-6
NUMEL = SLICES * ROWS * WIDTH  # one rank's buffer
FLAGS = ROWS  # flags per peer
CALLS = (0, 1, 2, 1, 2)  # a pass's slices: its first call, then alternating


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, buffers: list[torch.Tensor],
    flags: list[torch.Tensor], rank: int, world: int, slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel as FusedAllReduceNorm launches it, over `buffers` and `flags` mapped in this process."""
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.uint64)
    offset = slot * ROWS * WIDTH
    return fused_all_reduce.launch(
        x, residual, weight, EPS, buffer_ptrs.data_ptr(), flag_ptrs.data_ptr(), offset, rank, world
    )


def inputs(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank's partial, residual, norm weight) of a call; the residual and weight are the same on every rank."""
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * call + rank))
    shared = torch.Generator().manual_seed(7 + call)
    return x, torch.randn(ROWS, WIDTH, generator=shared), torch.rand(WIDTH, generator=shared)

"""The row-parallel layers' all-reduce fused with the residual add and RMSNorm after it: one kernel, one barrier.

Under tensor parallelism o_proj and down_proj leave each rank a partial sum; the next layer's norm then adds the
residual and normalises. Unfused that is two kernels a sublayer (PyTorch's one-shot all-reduce, with a barrier
before and after its reads, then the add-and-norm kernel): ~7.7 + ~2.2 us at batch 1 on 2x H200, 65 times a step
of an 8B model. Here each program takes one row: it copies the rank's partial row into its symmetric buffer,
meets the peers at a barrier (a flag per program and peer: set by the sender, cleared by the receiver), sums
every rank's row in rank order (so every rank gets the same bits), adds the residual and writes the stream and
its norm, rounded as add_rms_norm rounds them.

No barrier after the reads: consecutive calls write different slices of the buffer, so a rank refilling a slice
has passed a later call's barrier, which its peers reach only after reading that slice. A pass's first call (the
embedding's) takes slice 0 and its later calls alternate between 1 and 2 (`begin_pass`), so the same slice is
never used twice in a row, within a pass or across passes and graphs, whatever a pass's number of calls.

Where the kernel cannot run or does not pay (the CPU, gloo, more than MAX_FUSED_ROWS rows, a tensor over the
one-shot limit, another layout) the same result comes from the all-reduce and add_rms_norm apart.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from executor_service.models.fused_ops import add_rms_norm, next_power_of_2, row_warps
from executor_service.parallel.all_reduce import DTYPES, all_reduce

SLICES = 3  # 0: a pass's first call; 1 and 2 alternate after it
# Rows a call fuses: one program a row. On 2x H200 (8B shape) a batch-1 decode step ran 4.8 % faster fused, an 8-row
# verify as fast, but batch 32 1.3 % slower (32 programs read 256 KiB more slowly than PyTorch's one-shot kernel).
MAX_FUSED_ROWS = 8  # and the flags per peer: one per program


class FusedAllReduceNorm:
    """Symmetric buffers (SLICES slices of `max_bytes` per float dtype) and flags, set up on every rank at once."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.handles: dict[torch.dtype, Any] = {}
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in DTYPES:
            buffer = symm_mem.empty(SLICES * max_bytes // dtype.itemsize, dtype=dtype, device=device)
            self.handles[dtype] = symm_mem.rendezvous(buffer, group_name)
            self.buffers[dtype] = buffer
        self.flags = symm_mem.empty(MAX_FUSED_ROWS * dist.get_world_size(), dtype=torch.int32, device=device)
        self.flags.zero_()
        self.flag_handle = symm_mem.rendezvous(self.flags, group_name)
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero before any rank signals
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.calls = 0  # this pass's calls so far (begin_pass)

    def begin_pass(self) -> None:
        self.calls = 0

    def takes(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        rows, width = x.shape if x.dim() == 2 else (0, 0)
        return (
            x.dtype in self.buffers
            and x.is_contiguous()
            and 0 < rows <= MAX_FUSED_ROWS
            and 0 < x.numel() * x.element_size() <= self.max_bytes
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
            and weight.numel() == width
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slot = 0 if self.calls == 0 else 1 + (self.calls - 1) % 2
        self.calls += 1
        return launch(
            x, residual, weight, eps, self.handles[x.dtype].buffer_ptrs_dev, self.flag_handle.buffer_ptrs_dev,
            slot * self.max_bytes // x.element_size(), self.rank, self.world,
        )  # fmt: skip


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, buffer_ptrs: int,
    flag_ptrs: int, slice_offset: int, rank: int, world: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel over one call's rows: `buffer_ptrs` / `flag_ptrs` are the addresses of arrays of every rank's
    buffer and flags as mapped in this process, `slice_offset` the call's slice in elements. (normed, stream)."""
    rows, width = x.shape
    normed, stream = torch.empty_like(x), torch.empty_like(x)
    block = next_power_of_2(width)
    _kernel()[(rows,)](
        x, residual if residual is not None else x, weight, normed, stream, buffer_ptrs, flag_ptrs, slice_offset,
        width, eps, RANK=rank, WORLD=world, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=row_warps(block),
    )  # fmt: skip
    return normed, stream


_fused: FusedAllReduceNorm | None = None


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of x + residual), that stream): x is this rank's partial sum."""
    if _fused is not None and _fused.takes(x, residual, weight):
        return _fused(x, residual, weight, eps)
    return add_rms_norm(all_reduce(x), residual, weight, eps)


def begin_pass() -> None:
    """A target pass starts (its embedding's all-reduce comes first): the buffer slices' rotation restarts."""
    if _fused is not None:
        _fused.begin_pass()


def set_up_fused(device: torch.device, world_size: int, max_bytes: int) -> bool:
    """Every rank, after the group's all-reduces are set up: the fused kernel where symmetric memory and Triton
    are there on every rank (the ranks agree), else the all-reduce and norm apart. Returns whether it is on."""
    global _fused
    _fused = None
    if device.type != "cuda" or world_size < 2:
        return False
    fused = None
    try:
        fused = FusedAllReduceNorm(dist.group.WORLD.group_name, device, max_bytes)
        if not _sums_right(fused, device, world_size):
            fused = None
    except Exception:  # no peer access, an old torch or Triton: the unfused path
        fused = None
    ready = torch.tensor([1 if fused is not None else 0], device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    _fused = fused if int(ready.item()) == 1 else None
    return _fused is not None


def _sums_right(fused: FusedAllReduceNorm, device: torch.device, world_size: int) -> bool:
    """One call on every rank before any pass (it compiles the kernel too): rank r adds r + 1 to every element of
    a row of ones, so each rank must get the stream 1 + sum(1..N) and its norm the weight."""
    x = torch.full((2, 64), float(dist.get_rank() + 1), device=device)
    residual, weight = torch.ones_like(x), torch.full((64,), 0.5, device=device)
    normed, stream = fused(x, residual, weight, 1e-6)
    fused.begin_pass()
    expected = 1 + world_size * (world_size + 1) / 2
    return bool(torch.all(stream == expected)) and torch.allclose(normed, torch.full_like(normed, 0.5))


def forget_fused() -> None:
    global _fused
    _fused = None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def all_reduce_add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, buffer_ptrs, flag_ptrs, slice_offset, size, eps,
        RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < size
        at = slice_offset + row * size + offs
        element = x_ptr.dtype.element_ty
        buffer_ptrs = buffer_ptrs.to(tl.pointer_type(tl.uint64))  # each rank's buffer, mapped here
        flag_ptrs = flag_ptrs.to(tl.pointer_type(tl.uint64))
        x = tl.load(x_ptr + row * size + offs, mask=mask, other=0.0)
        own = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(element))
        tl.store(own + at, x, mask=mask)
        tl.debug_barrier()  # the whole row written before the flags say so
        program = tl.program_id(0)
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
                while tl.atomic_cas(flags + program * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                    pass
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
                while tl.atomic_cas(flags + program * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()  # every peer's row read after its flag
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: every rank sums the same bits the same way
            if peer == RANK:
                total += x.to(tl.float32)
            else:
                base = tl.load(buffer_ptrs + peer).to(tl.pointer_type(element))
                total += tl.load(base + at, mask=mask, other=0.0, volatile=True).to(tl.float32)
        summed = total.to(element)  # rounded as the all-reduce's output is
        h = summed.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * size + offs, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(element).to(tl.float32)  # rounded as torch's add rounds it
        tl.store(h_ptr + row * size + offs, h.to(element), mask=mask)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / size + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * size + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    return all_reduce_add_rms_norm_kernel

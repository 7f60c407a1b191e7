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

Push (`SPECDEC_TP_ALL_REDUCE=push`, under measurement): each rank stores its row straight into every peer's buffer
(its own section of the slice) and reads its peers' rows from its own buffer, waiting until no element still holds
the empty mark (-0.0, which no sent value is: a sender adds +0.0 first), then puts the mark back. One NVLink hop,
posted, where the flags cost a signal's round trip and a remote read; no flags at all. A slice is reused no sooner
than two calls later, when every peer has read it and put its marks back (a rank at call c has read its peers'
rows of c - 1, which they sent after finishing c - 2).

Where the kernel cannot run or does not pay (the CPU, gloo, more than MAX_FUSED_ROWS rows (pushed: PUSH_MAX_ROWS),
a tensor over the one-shot limit, another layout) the same result comes from the all-reduce and add_rms_norm apart.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from executor_service.models.fused_ops import add_rms_norm, next_power_of_2, row_warps
from executor_service.parallel.all_reduce import DTYPES, all_reduce

SLICES = 3  # 0: a pass's first call; 1 and 2 alternate after it
EMPTY = -0.0  # a pushed buffer's mark for "not yet written" (push)
# Rows a call fuses: one program a row. On 2x H200 (8B shape) a batch-1 decode step ran 4.8 % faster fused, an 8-row
# verify as fast, but batch 32 1.3 % slower (32 programs read 256 KiB more slowly than PyTorch's one-shot kernel).
MAX_FUSED_ROWS = 8  # and the flags per peer: one per program
# Pushed, a program reads its peers' rows from its own memory (no remote reads, no flags): whether it then beats
# PyTorch's one-shot kernel at batch 32-64 too is what its first GPU run measures.
PUSH_MAX_ROWS = 64


class FusedAllReduceNorm:
    """Symmetric buffers (SLICES slices of `max_bytes` per float dtype; pushed: a section of `max_bytes` per rank in
    each slice, filled with the empty mark) and flags, set up on every rank at once."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int, push: bool = False) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes, self.push = max_bytes, push
        self.max_rows = PUSH_MAX_ROWS if push else MAX_FUSED_ROWS
        self.handles: dict[torch.dtype, Any] = {}
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        sections = dist.get_world_size() if push else 1
        for dtype in DTYPES:
            buffer = symm_mem.empty(SLICES * sections * max_bytes // dtype.itemsize, dtype=dtype, device=device)
            if push:
                buffer.fill_(EMPTY)
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
            and 0 < rows <= self.max_rows
            and 0 < x.numel() * x.element_size() <= self.max_bytes
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
            and weight.numel() == width
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slot = 0 if self.calls == 0 else 1 + (self.calls - 1) % 2
        self.calls += 1
        section = self.max_bytes // x.element_size() if self.push else 0
        sections = self.world if self.push else 1
        return launch(
            x, residual, weight, eps, self.handles[x.dtype].buffer_ptrs_dev, self.flag_handle.buffer_ptrs_dev,
            slot * sections * self.max_bytes // x.element_size(), self.rank, self.world, section,
        )  # fmt: skip


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, buffer_ptrs: int,
    flag_ptrs: int, slice_offset: int, rank: int, world: int, section: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel over one call's rows: `buffer_ptrs` / `flag_ptrs` are the addresses of arrays of every rank's
    buffer and flags as mapped in this process, `slice_offset` the call's slice in elements; `section` (elements)
    > 0: pushed, each rank's rows at that stride within the slice (the flags unused). (normed, stream)."""
    import triton.language as tl

    rows, width = x.shape
    normed, stream = torch.empty_like(x), torch.empty_like(x)
    block = next_power_of_2(width)
    bits, mark = (tl.int16, -(1 << 15)) if x.element_size() == 2 else (tl.int32, -(1 << 31))  # -0.0's bits
    _kernel()[(rows,)](
        x, residual if residual is not None else x, weight, normed, stream, buffer_ptrs, flag_ptrs, slice_offset,
        section, width, eps, RANK=rank, WORLD=world, HAS_RESIDUAL=residual is not None, PUSH=section > 0,
        BITS=bits, MARK=mark, BLOCK=block, num_warps=row_warps(block),
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


def set_up_fused(device: torch.device, world_size: int, max_bytes: int, push: bool = False) -> bool:
    """Every rank, after the group's all-reduces are set up: the fused kernel (`push`: its pushed exchange) where
    symmetric memory and Triton are there on every rank (the ranks agree), else the all-reduce and norm apart.
    Returns whether it is on."""
    global _fused
    _fused = None
    if device.type != "cuda" or world_size < 2:
        return False
    fused = None
    try:
        fused = FusedAllReduceNorm(dist.group.WORLD.group_name, device, max_bytes, push)
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
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, buffer_ptrs, flag_ptrs, slice_offset, section, size, eps,
        RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PUSH: tl.constexpr, BITS: tl.constexpr,
        MARK: tl.constexpr, BLOCK: tl.constexpr,
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
        total = tl.zeros([BLOCK], dtype=tl.float32)
        if PUSH:
            x = (x.to(tl.float32) + 0.0).to(element)  # -0.0 -> +0.0: the empty mark is never sent
            for peer in tl.static_range(WORLD):
                if peer != RANK:
                    base = tl.load(buffer_ptrs + peer).to(tl.pointer_type(element))
                    tl.store(base + at + RANK * section, x, mask=mask)
            empty = tl.full([BLOCK], MARK, BITS).to(element, bitcast=True)  # -0.0: the sign bit alone
            for peer in tl.static_range(WORLD):  # rank order: every rank sums the same bits the same way
                if peer == RANK:
                    total += x.to(tl.float32)
                else:
                    part = own + at + peer * section
                    v = tl.load(part, mask=mask, other=1.0, volatile=True)
                    while tl.sum((v.to(BITS, bitcast=True) == MARK).to(tl.int32), 0) > 0:
                        v = tl.load(part, mask=mask, other=1.0, volatile=True)
                    total += tl.where(mask, v.to(tl.float32), 0.0)  # (the lanes past the row read 1.0)
                    tl.store(part, empty, mask=mask)  # read: empty again for the slice's next call
        else:
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

"""The counter-based random numbers' hash (device_sampling.py) as one Triton kernel per call on GPUs.

In torch a key costs ~50 int64 ops (each lowbias32 round is a dozen multiplies, shifts, xors and masks, and a key
is four rounds) and a row of uniforms ~25: a sampled device step derived its keys in 158 ops and its draws in
~50 more, each a kernel of a few elements inside the step's graph, at batch 1 about as long as the rest of the
sampled verification. Here each is one kernel. The arithmetic is the same integer arithmetic (int64 values below
2^49, no overflow; the multiplier constants split into 16-bit halves so no literal needs more than 32 bits), and
a uniform's conversion to float is exact, so the numbers are the torch path's bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

log = logging.getLogger("specdec.executor")

MASK32 = 0xFFFFFFFF
# lowbias32's multipliers 0x7FEB352D and 0x846CA68B (device_sampling.mix32) and the index's 0x9E3779B9
# (device_sampling.uniforms) appear in the kernels as 16-bit halves.
UNIFORM_BLOCK = 1024


_refused: list[BaseException] = []  # a kernel the compiler or driver refused once: the torch expressions from then on


def launched(launch: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """launch(), or None (the caller's torch expression: the same numbers) once a launch failed on this machine.
    A first launch runs eagerly, before any graph captures it (the graphs' warm-up runs), so a refusal shows there."""
    if _refused:
        return None
    try:
        return launch()
    except Exception as err:  # a compiler or driver without what the kernel needs: the torch ops instead
        _refused.append(err)
        log.warning("the sampling hash kernels are unavailable here; the torch ops run instead: %s", err)
        return None


def triton_step_keys(seed: torch.Tensor, step_key: torch.Tensor, streams: tuple[int, ...]) -> torch.Tensor:
    """[len(streams), N] int64: device_sampling.step_keys of step_key [N] (contiguous) for each stream, key i with
    seed[i // (N // len(seed))] (seed [B], N a multiple of B: each seed's keys consecutive)."""
    count = step_key.numel()
    out = torch.empty(len(streams), count, dtype=torch.int64, device=step_key.device)
    if count == 0:
        return out
    every = count // seed.numel()
    block = min(1024, max(16, 1 << (count - 1).bit_length()))
    for row, stream in enumerate(streams):
        _step_keys_kernel[(-(-count // block),)](seed, step_key, out[row], count, every, stream, MASK32, BLOCK=block)
    return out


def triton_uniforms(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] float32: device_sampling.uniforms of keys [B] (contiguous)."""
    rows = keys.shape[0]
    out = torch.empty(rows, count, dtype=torch.float32, device=keys.device)
    if rows and count:
        block = min(UNIFORM_BLOCK, max(16, 1 << (count - 1).bit_length()))
        _uniforms_kernel[(rows, -(-count // block))](keys, out, count, MASK32, BLOCK=block)
    return out


# The 32-bit mask travels as an argument (an int64 one: it does not fit in 32 bits), the multipliers as their 16-bit
# halves, so every literal is a plain 32-bit one.
@triton.jit
def _mul32(x, low_half, high_half, mask32):
    """x * (high_half << 16 | low_half) mod 2^32 for x in [0, 2^32), in int64 without overflow."""
    return (x * low_half + (((x * high_half) & 0xFFFF) << 16)) & mask32


@triton.jit
def _mix32(x, mask32):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB, mask32)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C, mask32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["count"])  # a batch of any size: one compile
def _step_keys_kernel(seed_ptr, key_ptr, out_ptr, count, every, stream, mask32, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    seed = tl.load(seed_ptr + offs // every, mask=mask, other=0)
    step_key = tl.load(key_ptr + offs, mask=mask, other=0)
    key = _mix32((seed & mask32) ^ _mix32((seed >> 32) & mask32, mask32), mask32)
    key = _mix32(key ^ (step_key & mask32), mask32)
    tl.store(out_ptr + offs, _mix32(key ^ stream, mask32), mask=mask)


@triton.jit
def _uniforms_kernel(keys_ptr, out_ptr, count, mask32, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    key = tl.load(keys_ptr + row)
    spread = _mul32(offs.to(tl.int64), 0x79B9, 0x9E37, mask32)
    bits = _mix32(key ^ spread, mask32) >> 8
    tl.store(out_ptr + row * count + offs, (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0), mask=mask)

"""Programmatic dependent launch (PDL, sm_90 and later): a kernel starts while the one before it finishes.

In the CUDA graph of a small model's decode step most of a kernel's few microseconds are the gap after the kernel
before it (the launch, then the first loads from memory), not its work. A kernel launched with
`launch_pdl=True` may start once every program of the kernel before it has called `gdc_launch_dependents` (or
exited): it loads what does not depend on that kernel (its weights), then waits in `gdc_wait` until that kernel
has finished and its writes are visible.

The rule every PDL kernel here keeps: nothing written by an earlier kernel is read, and nothing is stored, before
its `gdc_wait`; `gdc_launch_dependents` comes after the wait. So at most two kernels overlap, the second only
loading constants, and every kernel still sees all the writes of every kernel before it in the stream (the one
before it finished only after its own wait, and so on back).

Off under Triton's interpreter (it has no griddepcontrol), before sm_90, where the installed Triton lacks the
intrinsics, and with SPECDEC_PDL=0 (to measure against, or to rule it out).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

ENV = "SPECDEC_PDL"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_INTRINSICS = True
except ImportError:  # an older Triton: kernels are built with PDL off, so these never run
    HAVE_INTRINSICS = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are built with PDL and launched with `launch_pdl=True`."""
    if device.type != "cuda" or not HAVE_INTRINSICS or os.environ.get(ENV, "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip is not None:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(on: bool) -> dict[str, Any]:
    """The launch's keyword arguments for a kernel built with PDL `on` (`enabled`): `launch_pdl` only then (an
    older Triton knows no such option)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL: wait for the kernel before to finish, then let the next one start (after this kernel's wait,
    so that at most two kernels overlap). A kernel built without PDL does neither."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

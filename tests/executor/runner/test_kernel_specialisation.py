"""The fused QKV / RoPE / cache-write kernels and the checked argmax compile nothing after load for the pointers a run
hands them.

Triton compiles a kernel again for each new specialisation of its arguments: an integer's being 1 or a multiple of
16, a pointer's 16-byte alignment. The warm-up at load (runner/eager_warm_up.py) runs aligned slot mappings, but a
run slices a step's slots per part, so an int64 slot mapping starting at an odd row is 8 bytes off (on an H200 a
drafter flush at batch 3 recompiled the QKV kernel for 0.9 s in a timed round, 2026-11-29). These tests trace, on
the CPU, every layer's inputs that reach those kernels' pointers during the warm-up and during a run through held
context and flushes (test_deferred_context.py's), and check that every specialisation the run meets was met at
load, under each kernel's own flags. Negative control: with the slot pointer specialised, the run meets new ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from deferred_runs import run, session_for

from executor_service.models import fused_ops
from executor_service.models import model as model_module
from executor_service.models.rotary_cache import _kernel as rotary_launcher
from executor_service.runner.eager_warm_up import warm_up_models
from executor_service.spec_decode.deferred_context import DEFER_MAX
from kernels.kv_cache import _triton_writer
from kernels.qkv_rope_gemm import _qkv_rope_kernel

jit = pytest.importorskip("triton.runtime.jit")
compiler = pytest.importorskip("triton.backends.compiler")
if not hasattr(jit, "native_specialize_impl"):
    pytest.skip("this Triton computes specialisations elsewhere", allow_module_level=True)

# Each kernel's pointer parameters that a layer's inputs reach: (x, residual, x2, cos, sin, slots).
POINTERS = {
    "qkv_rope": (_qkv_rope_kernel, {"x_ptr": "x", "r_ptr": "residual", "x2_ptr": "x2", "cos_ptr": "cos",
                                    "sin_ptr": "sin", "slot_ptr": "slots"}),
    "rotary_store": (rotary_launcher().jit, {"cos_ptr": "cos", "sin_ptr": "sin", "slot_ptr": "slots"}),
    "write_kv": (_triton_writer().jit, {"slot_ptr": "slots"}),
}  # fmt: skip
Inputs = dict[str, torch.Tensor | None]


def exempt(kernel: Any, name: str) -> tuple[bool, bool]:
    """Whether the kernel's parameter `name` is exempt from value and from alignment specialisation, as its
    decorator says (a compiled kernel's flags, or under TRITON_INTERPRET the interpreted function's)."""
    flags = kernel.kwargs if hasattr(kernel, "kwargs") else vars(kernel)
    return name in (flags.get("do_not_specialize") or ()), name in (flags.get("do_not_specialize_on_alignment") or ())


def key(kernel: Any, inputs: Inputs, names: dict[str, str], honour_flags: bool = True) -> tuple:
    """The specialisation of `kernel`'s pointers for these inputs, as Triton computes it (`honour_flags` off: as if
    no parameter were exempt, the negative control)."""
    found = []
    for name, source in names.items():
        value = inputs[source]
        if value is None:
            continue
        no_value, no_alignment = exempt(kernel, name) if honour_flags else (False, False)
        found.append(
            (name, jit.native_specialize_impl(compiler.BaseBackend, value, False, not no_value, not no_alignment))
        )
    return tuple(found)


@contextmanager
def traced(into: list[Inputs]) -> Iterator[None]:
    """Every attention layer's inputs to its fused QKV kernel (or to RoPE and the cache write) while inside."""
    attention = model_module.Attention
    originals: dict[str, Callable[..., Any]] = {
        "project_and_store": attention.project_and_store,
        "store_context_kv": attention.store_context_kv,
    }

    def recorder(name: str) -> Callable[..., Any]:
        def record(self: Any, inp: Any, rotary: Any, kv_cache: Any, slots: torch.Tensor) -> Any:
            into.append({"x": inp.x, "residual": inp.residual, "x2": inp.x2, "cos": rotary[0], "sin": rotary[1],
                         "slots": slots})  # fmt: skip
            return originals[name](self, inp, rotary, kv_cache, slots)

        return record

    try:
        for name in originals:
            setattr(attention, name, recorder(name))
        yield
    finally:
        for name, function in originals.items():
            setattr(attention, name, function)


def warm_and_run(method: str) -> tuple[list[Inputs], list[Inputs]]:
    warm: list[Inputs] = []
    ran: list[Inputs] = []
    with traced(warm):
        session = session_for(method, False)
        warm_up_models(session.engine.runner, session.proposer, 512, 16)
    with traced(ran):
        for stretch in (5, 2 * DEFER_MAX + 3):  # flushes to draft, and at the held rows' bound
            run(session_for(method, False), stretch, 2 * stretch + 12)
    return warm, ran


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_run_meets_no_specialisation_the_warm_up_did_not(method: str) -> None:
    warm, ran = warm_and_run(method)
    misaligned = [i for i in ran if i["slots"].data_ptr() % 16]
    assert misaligned, "the run sliced no slot mapping off alignment: the test no longer sees the case"
    for kernel, names in POINTERS.values():
        warmed = {key(kernel, inputs, names) for inputs in warm}
        assert {key(kernel, inputs, names) for inputs in ran} <= warmed


def test_negative_control_a_specialised_slot_pointer_meets_new_ones() -> None:
    warm, ran = warm_and_run("eagle3")
    kernel, names = POINTERS["qkv_rope"]
    warmed = {key(kernel, inputs, names, honour_flags=False) for inputs in warm}
    assert {key(kernel, inputs, names, honour_flags=False) for inputs in ran} - warmed


def test_the_argmax_combine_kernel_specialises_alike_at_every_batch() -> None:
    """The checked argmax writes [finite | argmax] into one int64 buffer (fused_ops.triton_checked_argmax's
    `packed`): at an odd batch the argmax half starts 8 bytes off alignment. Control: specialised, it would
    compile once for odd batches and once for even ones."""
    kernel = fused_ops._kernels()["argmax_combine"]
    names = {"out_ptr": "out", "finite_ptr": "finite"}
    outputs = []
    for rows in (1, 2, 3, 4):
        packed = torch.empty(2 * rows, dtype=torch.int64)
        outputs.append({"finite": packed[:rows], "out": packed[rows:]})
    assert len({key(kernel, inputs, names) for inputs in outputs}) == 1
    assert len({key(kernel, inputs, names, honour_flags=False) for inputs in outputs}) == 2

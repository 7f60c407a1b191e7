"""The fused Triton ops (RMSNorm, SiLU-and-mul, argmax) against torch, under the interpreter on the CPU or
on the GPU: the kernels the model runs on GPUs, checked where CI can run them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from executor_service import fused_ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("rows", "size"), [(1, 64), (3, 576), (5, 100)])
def test_rms_norm_matches_torch(rows: int, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(rows, 2 * size, generator=generator) * 3).to(DEVICE)[:, :size]  # a strided row layout
    weight = torch.randn(size, generator=generator).to(DEVICE)
    got = fused_ops.triton_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (size,), weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_matches_torch_across_program_blocks() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 100, generator=generator).to(DEVICE)
    gate, up = gate_up.split(100, dim=-1)
    got = fused_ops.triton_silu_and_mul(gate_up, block=32)  # four programs per row, the last one partial
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_argmax_matches_torch_including_ties_across_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=generator)
    logits[1, 37] = logits[1, 90] = 50.0  # a tie in two different chunks: the first index wins
    logits[2, 64] = logits[2, 65] = 50.0  # a tie within one chunk
    logits[3, 99] = 50.0  # in the partial last chunk
    logits = logits.to(DEVICE)
    got = fused_ops.triton_argmax(logits, chunk=16)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got.tolist()[1:] == [37, 64, 99]


def test_cpu_tensors_take_the_torch_path() -> None:
    x = torch.randn(2, 8)
    torch.testing.assert_close(fused_ops.rms_norm(x, torch.ones(8), 1e-6), F.rms_norm(x, (8,), torch.ones(8), 1e-6))
    assert fused_ops.argmax(x).tolist() == x.argmax(dim=-1).tolist()

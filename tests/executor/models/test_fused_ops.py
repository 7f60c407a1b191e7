"""The fused ops (RMSNorm, SiLU-and-mul, argmax, the residual folded into a GEMM) against references written
out here in plain Python float64 arithmetic, not the torch calls the CPU fallback makes: the Triton kernels
under the interpreter on the CPU (the conftest sets TRITON_INTERPRET=1 there) or compiled on the GPU, and
the public functions on whichever path this machine takes."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from executor_service.models import fused_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_runs = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row: x / sqrt(mean(x^2) + eps) * weight, in Python floats."""
    w = weight.double().cpu().tolist()
    rows = []
    for row in x.double().cpu().tolist():
        rstd = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        rows.append([v * rstd * wi for v, wi in zip(row, w, strict=True)])
    return torch.tensor(rows, dtype=torch.float64)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate / (1 + e^-gate) * up, element by element, with gate the first half of each row."""
    rows = []
    for row in gate_up.double().cpu().tolist():
        half = len(row) // 2
        rows.append([g / (1.0 + math.exp(-g)) * u for g, u in zip(row[:half], row[half:], strict=True)])
    return torch.tensor(rows, dtype=torch.float64)


def argmax_reference(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum, by a scan."""
    result = []
    for row in logits.double().cpu().tolist():
        best = 0
        for i, v in enumerate(row):
            if v > row[best]:
                best = i
        result.append(best)
    return result


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.double().cpu(), expected, rtol=tol, atol=tol)


@triton_runs
@pytest.mark.parametrize(("rows", "size"), [(1, 64), (3, 576), (5, 100)])
def test_triton_rms_norm_matches_reference(rows: int, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(rows, 2 * size, generator=generator) * 3).to(DEVICE)[:, :size]  # a strided row layout
    weight = torch.randn(size, generator=generator).to(DEVICE)
    _close(fused_ops.triton_rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), 1e-5)


@triton_runs
@pytest.mark.parametrize(("rows", "size"), [(1, 64), (3, 576), (5, 100)])
def test_triton_add_rms_norm_writes_the_sum_and_its_norm(rows: int, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(rows, 2 * size, generator=generator) * 3).to(DEVICE)[:, :size]  # a strided row layout
    residual = torch.randn(rows, size, generator=generator).to(DEVICE)
    weight = torch.randn(size, generator=generator).to(DEVICE)
    normed, stream = fused_ops.triton_add_rms_norm(x, residual, weight, 1e-5)
    expected_stream = x.double().cpu() + residual.double().cpu()
    _close(stream, expected_stream, 1e-6)
    _close(normed, rms_norm_reference(expected_stream, weight, 1e-5), 1e-5)


@triton_runs
@pytest.mark.parametrize(("rows", "size", "size2"), [(1, 64, 64), (3, 576, 576), (4, 100, 36)])
def test_triton_concat_rms_norm_writes_both_norms_side_by_side(rows: int, size: int, size2: int) -> None:
    """EAGLE-3's attention input [norm(embedding) | norm(hidden)] in one kernel."""
    generator = torch.Generator().manual_seed(size2)
    x = (torch.randn(rows, 2 * size, generator=generator) * 3).to(DEVICE)[:, :size]  # a strided row layout
    x2 = torch.randn(rows, size2, generator=generator).to(DEVICE)
    weight, weight2 = torch.randn(size, generator=generator).to(DEVICE), torch.randn(size2, generator=generator)
    got = fused_ops.triton_concat_rms_norm(x, weight, x2, weight2.to(DEVICE), 1e-5)
    expected = torch.cat([rms_norm_reference(x, weight, 1e-5), rms_norm_reference(x2, weight2, 1e-5)], dim=-1)
    _close(got, expected, 1e-5)
    _close(fused_ops.concat_rms_norm(x, weight, x2, weight2.to(DEVICE), 1e-5), expected, 1e-5)


def test_add_rms_norm_without_a_residual_is_the_norm_of_x() -> None:
    x, weight = torch.randn(2, 32).to(DEVICE), torch.randn(32).to(DEVICE)
    normed, stream = fused_ops.add_rms_norm(x, None, weight, 1e-6)
    assert stream is x
    _close(normed, rms_norm_reference(x, weight, 1e-6), 1e-5)


@triton_runs
def test_triton_rms_norm_keeps_fp16_statistics_in_fp32() -> None:
    """Squares of 300 overflow fp16 (max 65504): statistics in fp16 would give inf and a zero row."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 64, generator=generator) * 300).half().to(DEVICE)
    weight = (torch.rand(64, generator=generator) + 0.5).half().to(DEVICE)
    got = fused_ops.triton_rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.float16
    _close(got, rms_norm_reference(x, weight, 1e-6), 2e-3)


@triton_runs
def test_triton_silu_and_mul_matches_reference_across_program_blocks() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 2 * 100, generator=generator) * 4).to(DEVICE)
    got = fused_ops.triton_silu_and_mul(gate_up, block=32)  # four programs per row, the last one partial
    _close(got, silu_and_mul_reference(gate_up), 1e-5)


@triton_runs
def test_triton_argmax_matches_reference_including_ties_across_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=generator)
    logits[1, 37] = logits[1, 90] = 50.0  # a tie in two different chunks: the first index wins
    logits[2, 64] = logits[2, 65] = 50.0  # a tie within one chunk
    logits[3, 99] = 50.0  # in the partial last chunk
    logits[4] = -1e30  # all equal (and far below zero): index 0
    logits = logits.to(DEVICE)
    got = fused_ops.triton_argmax(logits, chunk=16)
    assert got.dtype == torch.int64
    assert got.tolist() == argmax_reference(logits)
    assert got.tolist()[1:] == [37, 64, 99, 0]
    checked, finite = fused_ops.triton_checked_argmax(logits, chunk=16)
    assert checked.tolist() == got.tolist()
    assert finite.tolist() == [True] * 5


@triton_runs
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "torch"])
def test_checked_argmax_flags_rows_whose_maximum_is_not_finite(fused: bool) -> None:
    """A NaN or +inf anywhere in a row (in any chunk), or a row of -inf alone, is not finite; -inf entries beside
    finite ones are (masked tokens). The argmax of the finite rows is torch's."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 100, generator=generator)
    logits[1, 70] = float("nan")  # in a later chunk than the maximum
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :50] = float("-inf")  # masked tokens: still finite
    logits[5, 99] = float("nan")  # in the partial last chunk
    logits = logits.to(DEVICE)
    if fused:
        ids, finite = fused_ops.triton_checked_argmax(logits, chunk=16)
    else:
        ids, finite = fused_ops.checked_argmax(logits.cpu())
    assert finite.tolist() == [True, False, False, False, True, False]
    assert ids[[0, 4]].tolist() == [argmax_reference(logits)[i] for i in (0, 4)]
    packed = torch.empty(12, dtype=torch.int64, device=logits.device)  # what a greedy decode step reads back
    if fused:
        fused_ops.triton_checked_argmax(logits, chunk=16, packed=packed)
    else:
        packed = fused_ops.packed_checked_argmax(logits.cpu())
    assert packed[:6].tolist() == [1, 0, 0, 0, 1, 0]
    assert packed[[6, 10]].tolist() == ids[[0, 4]].tolist()


def test_public_functions_match_the_references_on_this_device() -> None:
    """rms_norm / silu_and_mul / argmax as the model calls them: torch on the CPU, Triton on a GPU."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 48, generator=generator).to(DEVICE)
    weight = torch.randn(48, generator=generator).to(DEVICE)  # not ones: a dropped weight shows
    _close(fused_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), 1e-5)
    _close(fused_ops.silu_and_mul(x), silu_and_mul_reference(x), 1e-5)
    logits = x.clone()
    logits[0, 5] = logits[0, 40] = 9.0
    assert fused_ops.argmax(logits).tolist() == argmax_reference(logits)
    assert fused_ops.argmax(logits).tolist()[0] == 5


@pytest.mark.parametrize("bias", [False, True], ids=["addmm", "bias"])
def test_linear_residual_adds_the_residual_to_the_gemm(bias: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    layer = nn.Linear(5, 4, bias=bias).to(DEVICE)
    x = torch.randn(3, 5, generator=generator).to(DEVICE)
    residual = torch.randn(3, 4, generator=generator).to(DEVICE)
    w, b = layer.weight.double().tolist(), layer.bias.double().tolist() if bias else [0.0] * 4
    expected = [
        [r[j] + b[j] + sum(xi * wj for xi, wj in zip(row, w[j], strict=True)) for j in range(4)]
        for row, r in zip(x.double().tolist(), residual.double().tolist(), strict=True)
    ]
    with torch.no_grad():
        _close(fused_ops.linear_residual(x, layer, residual), torch.tensor(expected, dtype=torch.float64), 1e-5)
        _close(fused_ops.linear_residual(x, layer, None), torch.tensor(expected) - residual.double().cpu(), 1e-5)

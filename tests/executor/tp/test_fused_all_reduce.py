"""The all-reduce fused with the residual add and RMSNorm (parallel/fused_all_reduce.py) under the Triton
interpreter on the CPU: one rank against add_rms_norm, and two ranks as two processes over shared memory (each maps
both ranks' buffers and flags from files, as symmetric memory maps peers' buffers on GPUs): the flags' handshake,
or the pushed rows and their empty marks (put back after every read), the sum in rank order, the buffer slices of
consecutive calls, with and without a residual. On GPUs every TP pass goes through it (test_tp_gpu.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fused_all_reduce_cases import CALLS, EPS, FLAGS, NUMEL, ROWS, WIDTH, buffer_numel, inputs, launch

from executor_service.models.fused_ops import add_rms_norm
from executor_service.parallel.fused_all_reduce import EMPTY, SLICES, _kernel

RUN = Path(__file__).with_name("fused_all_reduce_run.py")
TIMEOUT_S = 240.0


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _kernel.cache_clear()
    yield
    _kernel.cache_clear()


@pytest.mark.parametrize("with_residual", [True, False])
def test_one_rank_norms_like_add_rms_norm(with_residual: bool) -> None:
    x, residual, weight = inputs(0, 0)
    residual = residual if with_residual else None
    buffers, flags = [torch.zeros(NUMEL)], [torch.zeros(FLAGS, dtype=torch.int32)]
    normed, stream = launch(x, residual, weight, buffers, flags, 0, 1, slot=2)
    expected_normed, expected_stream = add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(normed, expected_normed)
    assert torch.equal(stream, expected_stream)
    slices = buffers[0].view(SLICES, ROWS, WIDTH)
    assert torch.equal(slices[2], x)  # the row went to its slice, for the peers
    assert torch.count_nonzero(slices[:2]) == 0


def test_one_rank_pushed_norms_like_add_rms_norm() -> None:
    x, residual, weight = inputs(0, 0)
    buffers, flags = [torch.full((NUMEL,), EMPTY)], [torch.zeros(FLAGS, dtype=torch.int32)]
    normed, stream = launch(x, residual, weight, buffers, flags, 0, 1, slot=1, push=True)
    expected_normed, expected_stream = add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(normed, expected_normed)
    assert torch.equal(stream, expected_stream)
    assert torch.equal(buffers[0].view(torch.int32), torch.full((NUMEL,), EMPTY).view(torch.int32))  # no peer


def run_ranks(tmp_path: Path, world: int, push: bool, dtype: torch.dtype) -> list[list]:
    """Every rank's process over buffers (empty marks where pushed) and flags in files; each rank's outputs."""
    fill = EMPTY if push else 0.0
    for rank in range(world):
        torch.full((buffer_numel(world, push),), fill, dtype=dtype).numpy().tofile(tmp_path / f"buffer_{rank}")
        torch.zeros(FLAGS * world, dtype=torch.int32).numpy().tofile(tmp_path / f"flags_{rank}")
    command = [sys.executable, str(RUN), "--world", str(world), "--dir", str(tmp_path), "--dtype", str(dtype)[6:]]
    ranks = [
        subprocess.Popen(
            [*command, "--rank", str(r), *(["--push"] if push else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [rank.communicate(timeout=TIMEOUT_S) for rank in ranks]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank never finished: the exchange is stuck")
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (_, stderr) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    return [torch.load(tmp_path / f"rank_{r}.pt") for r in range(world)]


def check_sums(got: list[list], world: int, dtype: torch.dtype) -> None:
    """Every rank's outputs of every call: add_rms_norm of the partials' sum, the same bits on every rank."""
    for call in range(len(CALLS)):
        partials = [inputs(r, call, dtype)[0] for r in range(world)]
        _, residual, weight = inputs(0, call, dtype)
        summed = (partials[0].float() + partials[1].float()).to(dtype)
        expected = add_rms_norm(summed, residual if call % 2 == 0 else None, weight, EPS)
        for rank in range(world):
            torch.testing.assert_close(got[rank][call][0], expected[0])
            assert torch.equal(got[rank][call][1], expected[1]), (rank, call)


def test_two_ranks_sum_in_rank_order_through_the_flags(tmp_path: Path) -> None:
    world = 2
    check_sums(run_ranks(tmp_path, world, False, torch.float32), world, torch.float32)
    flags = [torch.from_file(str(tmp_path / f"flags_{r}"), size=FLAGS * world, dtype=torch.int32) for r in range(world)]
    assert torch.count_nonzero(torch.stack(flags)) == 0  # every flag set was cleared by its receiver


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_ranks_sum_pushed_rows_and_put_the_marks_back(tmp_path: Path, dtype: torch.dtype) -> None:
    world = 2
    check_sums(run_ranks(tmp_path, world, True, dtype), world, dtype)
    numel = buffer_numel(world, True)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    mark = torch.full((numel,), EMPTY, dtype=dtype).view(bits)
    for rank in range(world):  # every row a peer pushed was read and marked empty again
        buffer = torch.from_file(str(tmp_path / f"buffer_{rank}"), size=numel, dtype=dtype)
        assert torch.equal(buffer.view(bits), mark), rank

"""Tensor parallelism's row-parallel layer (o_proj, down_proj) runs its partial GEMM through the fused small-M
kernels where the table picks one (the TP shards' own shapes, e.g. a 4-GPU down_proj), as a plain nn.Linear does;
its partial sums still add up to the whole layer's output. Under the Triton interpreter on the CPU, or on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from executor_service.models.fused_layer import NormInput, fused_config, linear
from executor_service.parallel.layers import RowParallelLinear
from kernels.small_gemm_table import POLICY_ENV

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class ScaledLinear(nn.Linear):
    """A subclass whose forward is not the plain GEMM: it must never be swapped for the fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_partial_sums_run_fused_and_add_up(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")  # every eligible shape fused
    torch.manual_seed(0)
    full = nn.Linear(48, 24, bias=bias, device=DEVICE)
    x = torch.randn(2, 48, device=DEVICE)
    shards = [RowParallelLinear(full, rank, 2) for rank in range(2)]
    partials = []
    for rank, shard in enumerate(shards):
        part = x[:, rank * 24 : (rank + 1) * 24].contiguous()
        assert fused_config("linear", NormInput(part), shard, shard.out_features) is not None
        partials.append(linear(part, shard))
        torch.testing.assert_close(partials[-1], shard(part), atol=1e-5, rtol=1e-5)  # the fused GEMM is forward's
    torch.testing.assert_close(sum(partials), full(x), atol=1e-5, rtol=1e-5)


def test_a_linear_with_its_own_forward_stays_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")
    layer = ScaledLinear(16, 8, device=DEVICE)
    x = torch.randn(1, 16, device=DEVICE)
    assert fused_config("linear", NormInput(x), layer, layer.out_features) is None
    torch.testing.assert_close(linear(x, layer), 2 * nn.functional.linear(x, layer.weight, layer.bias))

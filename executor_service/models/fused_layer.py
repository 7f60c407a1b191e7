"""The steps of a decoder layer that fuse around its GEMMs, whichever path runs them.

The layers leave each sublayer's residual add pending: a sublayer returns its output and the residual stream
it is to be added to, and the next GEMM's input is `NormInput` (x, residual, norm), i.e. rms_norm(x + residual).
Where kernels/small_gemm_table.py picks the fused small-M Triton kernels (decode and verify rows on a GPU, for
shapes measured faster than cuBLAS), the add, the norm and the activation run inside the GEMM; otherwise the
same math runs as separate ops: the add + RMSNorm kernel (fused_ops.add_rms_norm), cuBLAS, SiLU-and-mul; on
the CPU the plain torch ops.

The drafters' inputs that are two tensors side by side (EAGLE-3's attention input [norm(embedding) | norm(hidden)],
EAGLE-1's fc input [embedding | hidden]) are a NormInput with a second part: the fused kernels read both in their
prologue, the unfused path writes the concatenation first (one kernel: fused_ops.concat_rms_norm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from executor_service.models.fused_ops import add_rms_norm, concat_rms_norm, silu_and_mul
from kernels.small_gemm_table import GemmConfig, choose

# A partial sum's reduction over the tensor-parallel ranks with the residual add and RMSNorm after it:
# (x, residual, norm weight, eps) -> (normed, stream), as add_rms_norm of the summed x.
ReduceNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class NormInput:
    """A GEMM's input still to be formed: rms_norm(x + residual, weight, eps); without a residual rms_norm(x);
    without a norm weight (EAGLE-1's first layer) x + residual as is. With `x2` (no residual): the concatenation
    [rms_norm(x, weight) | rms_norm(x2, weight2)], or [x | x2] without the weights (both or neither). With
    `reduce` (tensor parallelism), x is this rank's partial sum and `reduce(x, residual, weight, eps)` sums it over
    the ranks, adds and norms in one (parallel/fused_all_reduce.py)."""

    x: torch.Tensor
    residual: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    eps: float = 1e-6
    x2: torch.Tensor | None = None
    weight2: torch.Tensor | None = None
    reduce: ReduceNorm | None = None

    @property
    def width(self) -> int:
        """The GEMM's K."""
        return self.x.shape[1] + (self.x2.shape[1] if self.x2 is not None else 0)

    def apply(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the GEMM's input, the residual stream x + residual) as separate ops; with x2 the stream is x."""
        if self.reduce is not None and self.weight is not None:
            return self.reduce(self.x, self.residual, self.weight, self.eps)
        if self.x2 is not None:
            if self.weight is None or self.weight2 is None:
                return torch.cat([self.x, self.x2], dim=-1), self.x
            return concat_rms_norm(self.x, self.weight, self.x2, self.weight2, self.eps), self.x
        if self.weight is not None:
            return add_rms_norm(self.x, self.residual, self.weight, self.eps)
        stream = self.x if self.residual is None else self.x + self.residual
        return stream, stream


def norm_input(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, reduce: ReduceNorm | None = None
) -> NormInput:
    """`norm` an RMSNorm (its weight and eps), or nn.Identity for none; `reduce`: x is a partial sum (NormInput)."""
    weight = getattr(norm, "weight", None)
    return NormInput(x, residual, weight, getattr(norm, "eps", 1e-6), reduce=reduce)


def _fusable(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dim() == 2 and t.stride(-1) == 1) for t in tensors)


def fused_config(op: str, inp: NormInput, layer: nn.Module, n: int) -> GemmConfig | None:
    """The fused kernel's config for `layer` (an nn.Linear whose forward is x @ weight.T + bias: a plain one, or
    one that says so with `plain_forward`, as tensor parallelism's row-parallel layer) on this input (not a
    partial sum: its reduction comes first), or None."""
    plain = type(layer) is nn.Linear or getattr(layer, "plain_forward", False)
    if not plain or inp.reduce is not None:
        return None
    if not _fusable(inp.x, inp.residual, inp.x2, layer.weight):
        return None
    if inp.x2 is not None and (inp.residual is not None or (inp.weight is None) != (inp.weight2 is None)):
        return None
    return choose(op, inp.x.shape[0], n, inp.width, inp.x.dtype, inp.x.device)


def gate_up_silu(inp: NormInput, gate_up_proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up of gate_up_proj(normed input), the residual stream)."""
    config = fused_config("gate_up_silu", inp, gate_up_proj, gate_up_proj.out_features)
    if config is not None and gate_up_proj.bias is None:
        from kernels.small_gemm import small_gemm

        return small_gemm(
            inp.x, gate_up_proj.weight, None, inp.residual, inp.weight, inp.eps, silu_mul=True, config=config,
            x2=inp.x2, norm_weight2=inp.weight2,
        )  # fmt: skip
    x, stream = inp.apply()
    return silu_and_mul(gate_up_proj(x)), stream


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """layer(x): o_proj and down_proj, whose residual add the next norm does."""
    return project(NormInput(x), layer)


def project(inp: NormInput, layer: nn.Module) -> torch.Tensor:
    """layer(the input formed): EAGLE-1's fc over [embedding | hidden] as one GEMM, no concatenation copy."""
    config = fused_config("linear", inp, layer, getattr(layer, "out_features", 0))
    if config is None:
        return layer(inp.apply()[0])
    from kernels.small_gemm import small_gemm

    return small_gemm(
        inp.x, layer.weight, layer.bias, inp.residual, inp.weight, inp.eps, config=config, x2=inp.x2,
        norm_weight2=inp.weight2,
    )[0]  # fmt: skip

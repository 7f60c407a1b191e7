"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with Llama 3.1 scaling."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from executor_service.models.config import ModelConfig, RopeScaling


def inverse_frequencies(head_size: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    if scaling is None:
        return inv_freq.float()
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """cos / sin for every position up to the model's context, looked up by each token's position."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        """Angles in fp32, the tables stored in the model's `dtype` (rounded as Hugging Face rounds them before
        use): a lookup is one gather, not a gather and a cast, in every step and every drafter chain step."""
        super().__init__()
        inv_freq = inverse_frequencies(config.head_size, config.rope_theta, config.rope_scaling)
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of each token's position (both halves of a head turn by the same angles):
        looked up once per step, shared by every layer."""
        return _as(self.cos[positions], dtype)[:, None, :], _as(self.sin[positions], dtype)[:, None, :]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by their tokens' positions [T]."""
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, k, cos, sin)


def _as(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return table if table.dtype == dtype else table.to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated; cos, sin [T, 1, D/2] from `RotaryEmbedding.lookup`.

    On GPUs one Triton kernel rotates q and k in place (eight elementwise kernels per layer otherwise,
    which is a tenth of a decode step); on the CPU the plain torch expression, as Hugging Face writes it.
    """
    if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
        _rotary_in_place()(q, k, cos, sin)
        return q, k
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.repeat(1, 1, 2) + rotated * sin.repeat(1, 1, 2)


@functools.cache
def _rotary_in_place() -> Callable[..., None]:
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
        NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        token, head = tl.program_id(0), tl.program_id(1)
        if head < NUM_Q_HEADS:
            base = q_ptr + token * stride_qt + head * stride_qh
        else:
            base = k_ptr + token * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        cos = tl.load(cos_ptr + token * stride_ct + offs, mask=mask).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_ct + offs, mask=mask).to(tl.float32)
        x1 = tl.load(base + offs, mask=mask).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask).to(tl.float32)
        tl.store(base + offs, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)

    def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        tokens, num_q_heads, head_size = q.shape
        if tokens == 0:
            return
        half = head_size // 2
        rotary_kernel[(tokens, num_q_heads + k.shape[1])](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, HALF=half, BLOCK=triton.next_power_of_2(half),
        )  # fmt: skip

    return rotate

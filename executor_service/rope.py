"""Rotary position embedding (the rotate-half layout of Hugging Face Llama), with Llama 3.1 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from executor_service.config import ModelConfig, RopeScaling


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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config.head_size, config.rope_theta, config.rope_scaling)
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of each token's position: computed once per step, shared by every layer."""
        cos = self.cos[positions].to(dtype).repeat(1, 2)[:, None, :]
        sin = self.sin[positions].to(dtype).repeat(1, 2)[:, None, :]
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by their tokens' positions [T]."""
        cos, sin = self.lookup(positions, q.dtype)
        return apply_rotary(q, k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

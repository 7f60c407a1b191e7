"""Llama and Qwen3 decoders on the paged attention kernels.

Hugging Face's module names, with vLLM's two fusions: q/k/v in one `qkv_proj` and gate/up in one
`gate_up_proj` (one matmul each instead of three and two). Qwen3 differs from Llama only by an
RMSNorm over each head of q and k before RoPE.

A layer leaves its sublayers' residual adds pending (as vLLM's layers do): it returns its MLP output and the
residual stream, and the next norm adds them (executor_service/models/fused_layer.py). On a GPU at decode and verify
sizes that makes a layer six kernels where the small-M Triton GEMMs are picked: (add + norm +) QKV + RoPE + K/V
write, attention (two with split-KV), o_proj, (add + norm +) gate/up + SiLU-and-mul, down_proj.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.models.attention_step import AttentionStep
from executor_service.models.config import ModelConfig
from executor_service.models.fused_layer import (
    NormInput,
    ReduceNorm,
    fused_config,
    gate_up_silu,
    linear,
    norm_input,
)
from executor_service.models.fused_ops import add_rms_norm, linear_residual, rms_norm, silu_and_mul
from executor_service.models.rope import RotaryEmbedding
from executor_service.models.rotary_cache import rotate_and_store
from kernels.small_gemm_table import GemmConfig

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin of this step's positions


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One kernel (statistics in fp32) instead of seven, 65 times per step."""
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, input_size: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = config.num_heads, config.num_kv_heads, config.head_size
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_size**-0.5
        in_features = input_size or config.hidden_size  # EAGLE-3 attends over [embedding; hidden]
        self.qkv_proj = nn.Linear(in_features, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.qk_norm = config.architecture == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps)

    def forward(
        self, inp: NormInput, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], step: AttentionStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_proj's output, the residual stream it is to be added to) of the input `inp` still to be normed."""
        q, stream = self.project_and_store(inp, rotary, kv_cache, step.slot_mapping)
        out = step.attend(q, kv_cache[0], kv_cache[1], self.scale)
        return linear(out.reshape(q.shape[0], self.q_size), self.o_proj), stream

    def project_and_store(
        self, inp: NormInput, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D] rotated, the residual stream): the input normed and projected, keys rotated and stored
        with the values at `slots`. One kernel where the fused QKV GEMM is picked."""
        k_cache, v_cache = kv_cache
        config = fused_config("qkv_rope", inp, self.qkv_proj, self.qkv_proj.out_features)
        cos, sin = rotary
        if config is not None and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1:
            from kernels.qkv_rope_gemm import qkv_rope_store

            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            return qkv_rope_store(
                inp.x, self.qkv_proj.weight, self.qkv_proj.bias, inp.residual, inp.weight, inp.eps,
                self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache, slots, qk_norm, config,
                x2=inp.x2, norm_weight2=inp.weight2,
            )  # fmt: skip
        x, stream = inp.apply()
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_size)
        k = k.reshape(tokens, self.num_kv_heads, self.head_size)
        v = v.reshape(tokens, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate_and_store(q, k, v, cos, sin, k_cache, v_cache, slots), stream

    def context_kv_config(self, inp: NormInput, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> GemmConfig | None:
        """The fused keys-and-values kernel's config for store_context_kv's input, or None (the unfused ops)."""
        k_cache, v_cache = kv_cache
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            return None
        return fused_config("qkv_rope", inp, self.qkv_proj, 2 * self.kv_size)

    def store_context_kv(
        self, inp: NormInput, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor
    ) -> None:
        """Project the input [T, H] (still to be normed) to keys and values only and store them (DFlash's context
        from target features). One kernel where the fused QKV kernel is picked."""
        weight = self.qkv_proj.weight[self.q_size :]
        bias = self.qkv_proj.bias[self.q_size :] if self.qkv_proj.bias is not None else None
        config = self.context_kv_config(inp, kv_cache)
        if config is not None:
            from kernels.qkv_rope_gemm import qkv_rope_store

            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.k_norm.eps) if self.qk_norm else None
            qkv_rope_store(
                inp.x, weight, bias, inp.residual, inp.weight, inp.eps, 0, self.num_kv_heads, *rotary, *kv_cache,
                slots, qk_norm, config,
            )  # fmt: skip
            return
        x, _ = inp.apply()
        tokens = x.shape[0]
        k, v = F.linear(x, weight, bias).split([self.kv_size, self.kv_size], dim=-1)
        k = k.reshape(tokens, self.num_kv_heads, self.head_size)
        v = v.reshape(tokens, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            k = self.k_norm(k)
        # No query heads: an empty view of k, so the kernel gets a real pointer.
        rotate_and_store(k[:, :0], k, v, *rotary, kv_cache[0], kv_cache[1], slots)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP output of x as is, plus `residual` when given (added by the down_proj GEMM itself)."""
        return linear_residual(silu_and_mul(self.gate_up_proj(x)), self.down_proj, residual)

    def fused(self, inp: NormInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(down_proj's output, the residual stream it is to be added to) of the input still to be normed."""
        act, stream = gate_up_silu(inp, self.gate_up_proj)
        return linear(act, self.down_proj), stream


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # Tensor parallelism (parallel/layers.py): the sublayers' outputs are partial sums, reduced in the next norm
        self.reduce_norm: ReduceNorm | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream it is to be added to) from the previous layer's pair
        (residual None: `hidden` is the stream itself, the embeddings)."""
        reduce = self.reduce_norm
        out, stream = self.self_attn(norm_input(hidden, residual, self.input_layernorm, reduce), rotary, kv_cache, step)
        return self.mlp.fused(norm_input(out, stream, self.post_attention_layernorm, reduce))


class DecoderModel(nn.Module):
    """Token ids of one step (all requests flattened) -> final hidden states; logits on demand."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config)
        # Tensor parallelism (parallel/layers.py): the embedding and the layers leave partial sums; `reduce_norm`
        # sums one with the final norm, `reduce` alone (the features drafters read)
        self.reduce_norm: ReduceNorm | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        step: AttentionStep,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states after the final norm, and the residual stream after each layer in `aux_layer_ids`
        (what EAGLE-3 and DFlash drafters read from the target)."""
        hidden = self.embed_tokens(input_ids)
        rotary = self.rope.lookup(positions, hidden.dtype)
        captured: dict[int, torch.Tensor] = {}
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rotary, kv_caches[index], step)
            if index in aux_layer_ids:
                summed = self.reduce(hidden) if self.reduce is not None else hidden
                captured[index] = summed + residual
        normed, _ = norm_input(hidden, residual, self.norm, self.reduce_norm).apply()
        return normed, [captured[i] for i in aux_layer_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

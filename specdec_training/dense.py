"""The target's and the drafters' layers on dense tensors [B, L, H], with SDPA and explicit masks.

Inference runs these same modules over the paged cache (model.py): q/k/v from `qkv_proj`, Qwen3's q/k
norms, rotate-half RoPE at each token's position, then attention over what the cache holds. Training
needs other attention patterns (EAGLE's unrolled steps, DFlash's blocks over context) and gradients,
so here the keys a query may see are explicit: keys of earlier passes (`prefix`) are concatenated and a
boolean mask says which are visible. The arithmetic is inference's; tests/training check the features
and the drafts against the engine. Norms and the MLP are written out here in plain torch, so that
autograd sees every op even where inference runs fused kernels (fused_ops.py) that have no backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.models.model import MLP, Attention, DecoderLayer, DecoderModel, RMSNorm
from executor_service.models.rope import RotaryEmbedding

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, L, 1, D] (fp32; cast to the activations' dtype)
KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, S, Hkv, D]


def rotary(rope: RotaryEmbedding, positions: torch.Tensor) -> Rotary:
    """cos, sin of positions [B, L], as `RotaryEmbedding.lookup` gives them for a flat step."""
    cos, sin = rope.cos[positions], rope.sin[positions]
    return torch.cat([cos, cos], dim=-1)[:, :, None, :], torch.cat([sin, sin], dim=-1)[:, :, None, :]


def rotate(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """Rotate-half RoPE (rope.apply_rotary's torch expression, differentiable; the GPU kernel is in place)."""
    cos, sin = rot[0].to(x.dtype), rot[1].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm (or EAGLE-1's Identity in its place)."""
    if isinstance(module, RMSNorm):
        return F.rms_norm(x, module.weight.shape, module.weight, module.eps)
    return module(x)


def mlp(module: MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_up_proj(x).split(module.intermediate_size, dim=-1)
    return module.down_proj(F.silu(gate) * up)


def project_qkv(attn: Attention, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, L, Hq, D], k and v [B, L, Hkv, D], as Attention.forward computes them before storing."""
    batch, length = x.shape[:2]
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(batch, length, attn.num_heads, attn.head_size)
    k = k.reshape(batch, length, attn.num_kv_heads, attn.head_size)
    v = v.reshape(batch, length, attn.num_kv_heads, attn.head_size)
    if attn.qk_norm:
        q, k = norm(attn.q_norm, q), norm(attn.k_norm, k)
    return rotate(q, rot), rotate(k, rot), v


def context_kv(attn: Attention, x: torch.Tensor, rot: Rotary) -> KV:
    """DFlash's context keys and values (Attention.store_context_kv): x projected by k/v only."""
    batch, length = x.shape[:2]
    weight = attn.qkv_proj.weight[attn.q_size :]
    bias = attn.qkv_proj.bias[attn.q_size :] if attn.qkv_proj.bias is not None else None
    k, v = F.linear(x, weight, bias).split([attn.kv_size, attn.kv_size], dim=-1)
    k = k.reshape(batch, length, attn.num_kv_heads, attn.head_size)
    v = v.reshape(batch, length, attn.num_kv_heads, attn.head_size)
    if attn.qk_norm:
        k = norm(attn.k_norm, k)
    return rotate(k, rot), v


def attend(
    attn: Attention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """o_proj(attention) of q [B, L, Hq, D] over keys/values [B, S, Hkv, D]; mask [B or 1, L, S], True: visible.
    Every query must see at least one key (all the masks built here include the query's own)."""
    batch, length = q.shape[:2]
    groups = attn.num_heads // attn.num_kv_heads
    keys = keys.repeat_interleave(groups, dim=2) if groups > 1 else keys
    values = values.repeat_interleave(groups, dim=2) if groups > 1 else values
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=attn.scale
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, attn.q_size))


def attention(
    attn: Attention, x: torch.Tensor, rot: Rotary, mask: torch.Tensor, prefix: KV | None = None
) -> tuple[torch.Tensor, KV]:
    """Self-attention of x over `prefix` keys then its own; returns the output and its own keys/values."""
    q, k, v = project_qkv(attn, x, rot)
    keys = k if prefix is None else torch.cat([prefix[0], k], dim=1)
    values = v if prefix is None else torch.cat([prefix[1], v], dim=1)
    return attend(attn, q, keys, values, mask), (k, v)


def decoder_layer(
    layer: DecoderLayer, x: torch.Tensor, rot: Rotary, mask: torch.Tensor, prefix: KV | None = None
) -> tuple[torch.Tensor, KV]:
    out, kv = attention(layer.self_attn, norm(layer.input_layernorm, x), rot, mask, prefix)
    x = x + out
    return x + mlp(layer.mlp, norm(layer.post_attention_layernorm, x)), kv


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]


def target_forward(
    model: DecoderModel, ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """DecoderModel.forward over right-padded sequences ids [B, L]: the final normed hidden states and the
    residual stream after each layer in `aux_layer_ids` (padding rows are computed and never read)."""
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch, length)
    rot = rotary(model.rope, positions)
    mask = causal_mask(length, ids.device)
    hidden = model.embed_tokens(ids)
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        hidden, _ = decoder_layer(layer, hidden, rot, mask)
        if index in aux_layer_ids:
            captured[index] = hidden
    return norm(model.norm, hidden), [captured[i] for i in aux_layer_ids]

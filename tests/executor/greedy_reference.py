"""Plain full-recompute greedy decoding: every token re-runs the whole sequence through dense causal SDPA,
with no cache, no paging, no batching. What the engine must reproduce token for token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_service.models.model import DecoderModel


@torch.no_grad()
def dense_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one sequence."""
    config = model.config
    device = model.embed_tokens.weight.device
    tokens = torch.tensor(ids, device=device)
    positions = torch.arange(len(ids), device=device)
    hidden = model.embed_tokens(tokens)
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(len(ids), config.num_heads, config.head_size)
        k = k.view(len(ids), config.num_kv_heads, config.head_size)
        v = v.view(len(ids), config.num_kv_heads, config.head_size)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = model.rope(positions, q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(len(ids), attn.q_size))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.compute_logits(model.norm(hidden))


def greedy_reference(
    model: DecoderModel, prompt: list[int], max_tokens: int, stop_ids: frozenset[int] = frozenset()
) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(dense_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
        if token in stop_ids:
            break
    return out

"""The drafters' training passes, dense, on the drafters' own modules (what save_drafter writes).

EAGLE / EAGLE-3, training-time test: step 0 is the engine's context pass over every row (row p reads
the target's feature at p and token p + 1, at position p). Step j >= 1 is chain step j of a proposal made
right after row p was verified: it reads token p + 1 + j (the true continuation, which is what the chain
feeds while its drafts are accepted) and the previous step's own output hidden state, at position p + j,
and sees step 0's keys of rows <= p plus the keys of row p's earlier steps: the keys the chain sees in
the drafter's cache. Step j at row p predicts token p + 2 + j.

DFlash: a block at anchor a is [token a, MASK x (B - 1)] at positions a .. a + B - 1. It sees the
context keys of positions < a (the verified prefix) and its own block (bidirectional unless the drafter
is causal), never other blocks; slot i predicts token a + i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.models.draft_models import DFlashDrafter, Eagle3Drafter, EagleDrafter
from specdec_training.dense import KV, Rotary, attention, context_kv, decoder_layer, mlp, norm, rotary
from specdec_training.features import shifted


@dataclass
class EagleStep:
    feedback: torch.Tensor  # [B, L, H] the hidden state the next chain step reads
    head: torch.Tensor  # [B, L, H] what the draft head reads


def eagle_unroll(
    drafter: EagleDrafter | Eagle3Drafter, ids: torch.Tensor, features: torch.Tensor, steps: int
) -> list[EagleStep]:
    """`steps` unrolled steps over ids [B, L] with the target's features [B, L, F]."""
    batch, length = ids.shape
    device = ids.device
    base = torch.arange(length, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    own = torch.eye(length, dtype=torch.bool, device=device)
    num_layers = len(drafter.layers) if isinstance(drafter, EagleDrafter) else 1
    keys: list[list[KV]] = [[] for _ in range(num_layers)]  # per layer, per earlier step
    hidden = drafter.combine(features)
    limit = drafter.config.model.max_position_embeddings - 1
    out: list[EagleStep] = []
    for j in range(steps):
        step_ids = shifted(ids, 1 + j)
        rot = rotary(drafter.rope, (base + j).clamp(max=limit).expand(batch, length))
        mask = torch.cat([causal, *[own] * j], dim=-1)[None]
        prefixes = [_concat(layer_keys) for layer_keys in keys]
        feedback, head, new = _eagle_step(drafter, step_ids, hidden, rot, mask, prefixes)
        for layer_keys, kv in zip(keys, new, strict=True):
            layer_keys.append(kv)
        out.append(EagleStep(feedback, head))
        hidden = feedback
    return out


def _concat(kvs: list[KV]) -> KV | None:
    if not kvs:
        return None
    return torch.cat([k for k, _ in kvs], dim=1), torch.cat([v for _, v in kvs], dim=1)


def _eagle_step(
    drafter: EagleDrafter | Eagle3Drafter,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    rot: Rotary,
    mask: torch.Tensor,
    prefixes: list[KV | None],
) -> tuple[torch.Tensor, torch.Tensor, list[KV]]:
    """EagleDrafter.forward / Eagle3Drafter.forward, dense."""
    embeds = drafter.embed(ids)
    if isinstance(drafter, EagleDrafter):
        x = drafter.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1))
        new = []
        for layer, prefix in zip(drafter.layers, prefixes, strict=True):
            x, kv = decoder_layer(layer, x, rot, mask, prefix)
            new.append(kv)
        return x, x, new
    layer = drafter.midlayer
    x = torch.cat([norm(layer.input_layernorm, embeds), norm(layer.hidden_norm, hidden)], dim=-1)
    out, kv = attention(layer.self_attn, x, rot, mask, prefixes[0])
    hidden = hidden + out
    hidden = hidden + mlp(layer.mlp, norm(layer.post_attention_layernorm, hidden))
    return hidden, norm(drafter.norm, hidden), [kv]


def dflash_blocks(
    drafter: DFlashDrafter, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """The blocks' normed hidden states [B, A, block_size, H] for anchors [B, A] (each >= 1)."""
    assert drafter.target is not None
    config = drafter.config
    size, limit = config.block_size, config.model.max_position_embeddings - 1
    batch, length = ids.shape
    num_anchors = anchors.shape[1]
    device = ids.device
    context = norm(drafter.hidden_norm, drafter.fc(features))
    context_rot = rotary(drafter.rope, torch.arange(length, device=device).expand(batch, length))
    offsets = torch.arange(size, device=device)
    positions = (anchors[..., None] + offsets).clamp(max=limit).view(batch, num_anchors * size)
    block_ids = torch.full((batch, num_anchors, size), config.mask_token_id, dtype=ids.dtype, device=device)
    block_ids[..., 0] = ids.gather(1, anchors)
    x = drafter.target.embed_tokens(block_ids.view(batch, num_anchors * size))
    rot = rotary(drafter.rope, positions)
    mask = dflash_mask(anchors, length, size, config.causal)
    for layer in drafter.layers:
        prefix = context_kv(layer.self_attn, context, context_rot)
        x, _ = decoder_layer(layer, x, rot, mask, prefix)
    return norm(drafter.norm, x).view(batch, num_anchors, size, -1)


def dflash_mask(anchors: torch.Tensor, length: int, size: int, causal: bool) -> torch.Tensor:
    """[B, A * size, length + A * size]: context positions before the query's anchor, and its own block."""
    batch, num_anchors = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(size, dim=1)  # [B, A * size]
    context = torch.arange(length, device=device)[None, None] < query_anchor[..., None]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(size)
    same_block = block_of[:, None] == block_of[None, :]
    if causal:
        offset = torch.arange(size, device=device).repeat(num_anchors)
        same_block = same_block & (offset[None, :] <= offset[:, None])
    return torch.cat([context, same_block[None].expand(batch, -1, -1)], dim=-1)

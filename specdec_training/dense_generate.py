"""Bulk generation of training text: the target's layers over a dense KV cache, one fixed batch at a time.

The engine serves requests (continuous batching, a paged cache, per-request sampling with its own seeded
generator, stop checks and output callbacks every step). That host work grows with the batch: on an H100 the
engine wrote SmolLM2's training text at about 11k tokens/s at 512 requests, far below what the GPU can do for a
135M model. Training text needs none of it. Here a batch of prompts of similar length is prefilled at once
(dense.py's layers, SDPA with a causal mask), then decoded together: each step is one [B, 1] pass whose keys
and values go to the row's own position in a dense cache [B, Hkv, T, D], greedy rows take the argmax and
sampled rows one exponential race over the whole batch. Finished rows are dropped every COMPACT_EVERY steps.

A response ends with the first stop id (included, as the engine's output does) or at its token budget.
Sampled rows draw from one generator per batch, seeded from `seed` and the batch's first prompt: a run is
reproducible, though a response depends on which prompts it was batched with (unlike the engine's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from executor_service.models.model import DecoderModel
from specdec_training.dense import decoder_layer, mlp, norm, project_qkv, rotary

COMPACT_EVERY = 32  # decode steps between drops of finished rows (each drop copies the cache once)
PREFILL_ROWS = 32  # prompts prefilled at once
# Not cuDNN's attention: it builds a plan per new shape, and here the key window grows every step (on an H100
# each decode step took ~90 ms, almost all of it planning). The other backends take any shape as it comes.
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.inference_mode()
@sdpa_kernel(BACKENDS)
def generate_dense(
    model: DecoderModel,
    prompts: list[list[int]],
    temperatures: list[float],
    max_new_tokens: list[int],
    stop_ids: set[int],
    seed: int,
    batch_size: int = 256,
) -> list[list[int]]:
    """One response per prompt, in prompt order. Prompts are batched by length (longest first), so a batch's
    padding is small; temperatures 0 are greedy."""
    if not len(prompts) == len(temperatures) == len(max_new_tokens):
        raise ValueError("prompts, temperatures and max_new_tokens must have one entry per prompt")
    if batch_size < 1 or any(not p for p in prompts) or any(n < 1 for n in max_new_tokens):
        raise ValueError("batch_size, every prompt's length and every token budget must be at least 1")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    responses: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed * 1_000_003 + rows[0])
        batch = _generate_batch(
            model,
            [prompts[i] for i in rows],
            [temperatures[i] for i in rows],
            [max_new_tokens[i] for i in rows],
            stop_ids,
            generator,
        )
        for row, response in zip(rows, batch, strict=True):
            responses[row] = response
    return responses


def _generate_batch(
    model: DecoderModel,
    prompts: list[list[int]],
    temperatures: list[float],
    max_new_tokens: list[int],
    stop_ids: set[int],
    generator: torch.Generator,
) -> list[list[int]]:
    device = model.embed_tokens.weight.device
    count, longest, budget = len(prompts), max(len(p) for p in prompts), max(max_new_tokens)
    ids = torch.zeros(count, longest, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    ids = ids.to(device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    caches, logits = _prefill(model, ids, lengths, longest + budget)

    temps = torch.tensor(temperatures, device=device, dtype=torch.float32)
    limits = torch.tensor(max_new_tokens, device=device)
    stops = torch.tensor(sorted(stop_ids), device=device, dtype=torch.long)
    out = torch.zeros(count, budget, dtype=torch.long, device=device)
    alive = torch.arange(count, device=device)  # original row of each row still decoding
    sampled = any(t > 0 for t in temperatures)
    for step in range(budget):
        token = _sample(logits, temps, generator) if sampled else logits.argmax(dim=-1)
        out[alive, step] = token
        done = torch.isin(token, stops) | (limits <= step + 1)
        if step + 1 == budget:
            break
        if (step + 1) % COMPACT_EVERY == 0:
            keep = (~done).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            if keep.numel() < alive.numel():
                alive, token, temps, limits, lengths = (t[keep] for t in (alive, token, temps, limits, lengths))
                caches = [(k[keep], v[keep]) for k, v in caches]
        logits = _decode(model, token, lengths + step, caches, longest + step + 1)

    responses = []
    for row, limit in zip(out.tolist(), max_new_tokens, strict=True):
        end = next((i + 1 for i, t in enumerate(row[:limit]) if t in stop_ids), limit)
        responses.append(row[:end])
    return responses


def _prefill(
    model: DecoderModel, ids: torch.Tensor, lengths: torch.Tensor, capacity: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The right-padded prompts [B, L] through every layer, PREFILL_ROWS rows at a time (bounded activations
    whatever attention kernel SDPA picks): each layer's keys and values in a cache of `capacity` positions
    [B, Hkv, capacity, D], and the logits after each prompt's last token [B, V]."""
    count, length = ids.shape
    attn = model.layers[0].self_attn
    shape = (count, attn.num_kv_heads, capacity, attn.head_size)
    dtype = model.embed_tokens.weight.dtype
    caches = [(ids.new_zeros(shape, dtype=dtype), ids.new_zeros(shape, dtype=dtype)) for _ in model.layers]
    mask = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()[None]
    last = []
    for start in range(0, count, PREFILL_ROWS):
        rows = slice(start, start + PREFILL_ROWS)
        chunk = ids[rows]
        rot = rotary(model.rope, torch.arange(length, device=ids.device).expand(chunk.shape[0], length))
        hidden = model.embed_tokens(chunk)
        for layer, (k_cache, v_cache) in zip(model.layers, caches, strict=True):
            hidden, (k, v) = decoder_layer(layer, hidden, rot, mask)
            k_cache[rows, :, :length] = k.transpose(1, 2)
            v_cache[rows, :, :length] = v.transpose(1, 2)
        last.append(hidden[torch.arange(chunk.shape[0], device=ids.device), lengths[rows] - 1])
    return caches, model.compute_logits(norm(model.norm, torch.cat(last)))


def _decode(
    model: DecoderModel,
    token: torch.Tensor,
    positions: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    window: int,
) -> torch.Tensor:
    """One token per row at its own position: keys and values stored at that slot, attention over the slots
    up to it (earlier slots of a shorter prompt hold its own generated tokens, never padding)."""
    count = token.shape[0]
    rows = torch.arange(count, device=token.device)
    rot = rotary(model.rope, positions[:, None])
    visible = (torch.arange(window, device=token.device)[None] <= positions[:, None])[:, None, None]  # [B,1,1,S]
    hidden = model.embed_tokens(token)[:, None]
    for layer, (k_cache, v_cache) in zip(model.layers, caches, strict=True):
        attn = layer.self_attn
        q, k, v = project_qkv(attn, norm(layer.input_layernorm, hidden), rot)
        k_cache[rows, :, positions] = k[:, 0]
        v_cache[rows, :, positions] = v[:, 0]
        groups = attn.num_heads // attn.num_kv_heads  # query heads kv*groups .. share kv head `kv`
        q = q.reshape(count, attn.num_kv_heads, groups, attn.head_size)
        o = F.scaled_dot_product_attention(
            q, k_cache[:, :, :window], v_cache[:, :, :window], attn_mask=visible, scale=attn.scale
        )
        hidden = hidden + attn.o_proj(o.reshape(count, 1, attn.q_size))
        hidden = hidden + mlp(layer.mlp, norm(layer.post_attention_layernorm, hidden))
    return model.compute_logits(norm(model.norm, hidden[:, 0]))


def _sample(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Greedy where the temperature is 0, else a draw from softmax(logits / T) (an exponential race)."""
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperatures.clamp_min(1e-5)[:, None], dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(temperatures > 0, (probs / noise).argmax(dim=-1), greedy)

"""CPU_ATTN: torch SDPA over each request's gathered keys and values. The CPU default and the
reference the other backends are checked against; it also runs on GPUs (slowly) for that purpose.
Tree masks (kernels/tree_mask.py) narrow the causal mask it builds per request."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBatch
from kernels.tree_mask import window_visible


def unavailable_reason(device: torch.device) -> str | None:
    return None


def forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, out: torch.Tensor | None
) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        blocks = batch.block_table[b, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)  # [S, Hkv, D]
        values = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)
        mask = None
        if batch.causal:  # bottom-right aligned: query i sees keys <= context_len + i
            context_len = seq_len - query_len
            positions = torch.arange(seq_len, device=q.device)
            mask = positions[None, :] <= context_len + torch.arange(query_len, device=q.device)[:, None]
            if batch.tree_mask is not None:  # tree drafting: only the ancestors among the newest keys
                mask &= window_visible(batch.tree_mask[q_start:q_end, None], positions[None, :], seq_len)
        result = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1),
            keys.repeat_interleave(group, dim=1).transpose(0, 1),
            values.repeat_interleave(group, dim=1).transpose(0, 1),
            attn_mask=mask,
            scale=batch.scale,
        )
        out[q_start:q_end] = result.transpose(0, 1)
    return out

"""The block-sparse kernel FLEX_ATTENTION's metadata describes, emulated densely on the CPU, so a test can check
which blocks a batch's block mask visits (imported as `flex_emulation`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.flex_attn import Q_BLOCK, FlexMetadata
from kernels.testing import PagedBatch


def _blocks(num: torch.Tensor, indices: torch.Tensor | None) -> list[set[int]]:
    """Each tile's listed blocks; a block listed twice would be summed twice by the kernel."""
    lists = [row[:n].tolist() for row, n in zip(indices[0, 0], num[0, 0].tolist(), strict=True)]
    assert all(len(set(blocks)) == len(blocks) for blocks in lists), "a block listed twice in one tile"
    return [set(blocks) for blocks in lists]


def emulate_sparse_kernel(batch: PagedBatch, meta: FlexMetadata, scale: float) -> torch.Tensor:
    """What the compiled kernel computes: per tile only the listed blocks, mask_mod on partial ones only, and every
    loaded value row multiplied by its weight (so a NaN in any loaded block would show)."""
    mask = meta.block_mask
    block_size = batch.k_cache.shape[1]
    q = F.pad(batch.q.double(), (0, 0, 0, 0, 0, meta.padded_tokens - batch.q.shape[0]))
    group = q.shape[1] // batch.k_cache.shape[2]
    out = torch.zeros_like(q)
    partial, full = _blocks(mask.kv_num_blocks, mask.kv_indices), _blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
    for tile, (part, whole) in enumerate(zip(partial, full, strict=True)):
        rows = torch.arange(tile * Q_BLOCK, (tile + 1) * Q_BLOCK)
        blocks = sorted(part) + sorted(whole)
        if not blocks:
            continue
        slots = (torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)).flatten()
        allowed = mask.mask_mod(0, 0, rows[:, None], slots[None, :])
        allowed[:, len(part) * block_size :] = True
        keys = batch.k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        values = batch.v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) * scale
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", weights, values)
    return out[: batch.q.shape[0]]

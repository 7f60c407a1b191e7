"""A model's logits through the paged path (KV cache, attention step) for one sequence, to compare with a reference
on the same weights (imported as `paged_reference`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import AttentionStep
from executor_service.models.model import DecoderModel

CPU = torch.device("cpu")


def paged_logits(model: DecoderModel, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One request's logits through the paged path: blocks in reverse order, so paging is exercised."""
    config = model.config
    num_blocks = -(-len(ids) // block_size) + 2
    cache = KVCache(config, num_blocks, block_size, torch.float32, CPU)
    blocks = list(range(num_blocks - 1, 1, -1))
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(len(ids))])
    step = AttentionStep(
        "CPU_ATTN",
        torch.tensor([blocks], dtype=torch.int32),
        torch.tensor([0, len(ids)], dtype=torch.int32),
        torch.tensor([len(ids)], dtype=torch.int32),
        slots,
        len(ids),
        len(ids),
    )
    with torch.no_grad():
        hidden, _ = model(torch.tensor(ids), torch.arange(len(ids)), cache.layers, step)
        return model.compute_logits(hidden)

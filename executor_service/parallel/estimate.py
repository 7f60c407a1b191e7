"""Rank 0's share of a load's memory under tensor parallelism (what LoadModel checks against its device).

memory.estimate_memory prices the whole target. Rank 0 holds 1/N of the target's weights and of its KV cache,
plus, with a drafter, the whole embedding and LM head the drafter uses (parallel/driver.py FullHeads). The
drafter, its cache and the activations (logits are whole on rank 0) stay as estimated. The other ranks hold
less than rank 0, so rank 0's device is the one that decides.
"""

from __future__ import annotations

import math

import torch

from executor_service.engine.kv_cache import bytes_per_block
from executor_service.models.config import ModelConfig
from executor_service.models.weights import hf_layout
from executor_service.server.memory import MemoryEstimate


def rank_zero_estimate(
    whole: MemoryEstimate,
    target: ModelConfig,
    has_drafter: bool,
    dtype: torch.dtype,
    num_kv_blocks: int,
    block_size: int,
    size: int,
) -> MemoryEstimate:
    if size == 1:
        return whole
    element = torch.empty((), dtype=dtype).element_size()
    target_weights = sum(math.prod(p.shape) for p in hf_layout(target).values()) * element
    heads = (1 if target.tie_word_embeddings else 2) * target.vocab_size * target.hidden_size * element
    target_cache = num_kv_blocks * bytes_per_block(target, block_size, dtype)
    weights = whole.weights - target_weights + -(-target_weights // size) + (heads if has_drafter else 0)
    kv_cache = whole.kv_cache - target_cache + target_cache // size
    return MemoryEstimate(weights, kv_cache, whole.activations)

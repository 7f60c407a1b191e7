"""The paged KV cache: one tensor pair per layer, its block ids, and how many blocks fit.

Blocks are held by requests (their block tables) and come back on finish, abort, cancel, error and
preemption; `BlockPool.num_used` (block_pool.py) is what the no-leak tests and the metrics read.
"""

from __future__ import annotations

import torch

from executor_service.engine.block_pool import BlockPool
from executor_service.errors import NoRoomForKVCache
from executor_service.models.config import ModelConfig


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element


def blocks_for_memory_fraction(
    configs: list[ModelConfig], block_size: int, dtype: torch.dtype, device: torch.device, fraction: float
) -> int:
    """Blocks that fit in `fraction` of the device's memory after what is already allocated (the weights),
    keeping a margin for activations. A block holds K/V of every model in `configs` (target, drafter).
    CUDA only: a CPU run names --num-kv-blocks."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    activations = 2 << 30  # logits of a large prefill chunk, MLP intermediates, allocator slack
    budget = int(total * fraction) - used - activations
    count = budget // sum(bytes_per_block(config, block_size, dtype) for config in configs)
    if count <= 0:
        raise NoRoomForKVCache(
            f"gpu_memory_utilization {fraction} leaves no room for the KV cache "
            f"({used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return int(count)


def copy_kv_slots(storage: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of cache slots `src` to `dst` in every layer of `storage` (KVCache.storage), gathered first, so
    a slot both read and written is read before it is overwritten: a tree's accepted drafts' K/V moved into place.
    Two kernels for all layers (every layer's K and V viewed by slot)."""
    by_slot = storage.view(storage.shape[0] * 2, -1, *storage.shape[4:])
    by_slot[:, dst] = by_slot[:, src]


class KVCache:
    """k and v [num_blocks, block_size, num_kv_heads, head_size] per layer, in one allocation."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        allocator: BlockPool | None = None,
    ) -> None:
        """`allocator`: share another cache's block ids (the drafter's cache uses the target's)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_size)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers)]
        self.allocator = allocator or BlockPool(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

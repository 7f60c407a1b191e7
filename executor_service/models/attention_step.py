"""The attention metadata of one engine step, built once and used by every layer.

The model's layers only call `attend`; which kernel runs, and what it needs prepared per step (flex's
BlockMask), stays here. Host-side bounds (max query / sequence length) come from the scheduler, so no
layer ever syncs with the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import paged_attention
from kernels.attention import check_claimed

if TYPE_CHECKING:
    from kernels.flex_attn import FlexMetadata


@dataclass
class AttentionStep:
    backend: str
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: context + this step's tokens
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (-1: do not store)
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    tree_mask: torch.Tensor | None = None  # [T] int64: tree attention (kernels/tree_mask.py); None: none
    _flex: FlexMetadata | None = field(default=None, repr=False)  # built by the first layer that needs it

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the paged cache (this step's keys already stored)."""
        if self.backend == "FLEX_ATTENTION":
            return self._attend_flex(q, k_cache, v_cache, scale)
        return paged_attention(
            self.backend,
            q,
            k_cache,
            v_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.causal,
            scale,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            tree_mask=self.tree_mask,
        )

    def _attend_flex(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        from kernels import flex_attn

        if self._flex is None:  # first layer of the step: check the call once, build the BlockMask once
            check_claimed(self.backend, q, k_cache, self.causal, tree=self.tree_mask is not None)
            self._flex = flex_attn.build_flex_metadata(
                self.block_table,
                self.query_start_loc,
                self.seq_lens,
                self.causal,
                num_blocks=k_cache.shape[0],
                block_size=k_cache.shape[1],
                num_tokens=q.shape[0],
                tree_mask=self.tree_mask,
            )
        return flex_attn.forward_with_metadata(q, k_cache, v_cache, self._flex, scale)


def cache_slot(block_ids: list[int], position: int, block_size: int) -> int:
    """The paged-cache slot of `position` in a request's blocks; -1 (written nowhere) past its blocks."""
    block = position // block_size
    if block >= len(block_ids):
        return -1
    return block_ids[block] * block_size + position % block_size


def cache_slots(block_ids: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """`cache_slot` of positions start, ..., stop - 1: a range per block instead of a call per position (a prompt
    chunk's rows, a flush of held drafter context)."""
    slots: list[int] = []
    position = start
    while position < stop:
        block = position // block_size
        if block >= len(block_ids):
            slots += [-1] * (stop - position)
            break
        end = min(stop, (block + 1) * block_size)
        offset = (block_ids[block] - block) * block_size  # slot = block id x block size + position in the block
        slots += range(offset + position, offset + end)
        position = end
    return slots


# Host lists become tensors through numpy: ~3x faster than torch.tensor at every size (1 us against 2.8 for one
# value, 49 against 157 for a 3,000-token prompt's positions on the 2-core CPU host); a long prompt's step builds
# several such lists (its ids, positions and slots, and the drafter's context pass's).
NUMPY_DTYPES = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on the CPU, through numpy where it has the dtype."""
    numpy_dtype = NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=numpy_dtype))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a device tensor without waiting for the device: on CUDA through pinned memory and an
    asynchronous copy (a plain `torch.tensor(..., device=cuda)` synchronizes the stream, so it would wait for
    the step in flight)."""
    host = host_tensor(values, dtype)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def block_table_tensor(block_ids: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, max blocks] int32: each request's block ids, padded with block 0 (never read past seq_lens)."""
    width = max(len(blocks) for blocks in block_ids)
    return to_device([blocks + [0] * (width - len(blocks)) for blocks in block_ids], torch.int32, device)


def build_attention_step(
    backend: str,
    block_ids: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    slots: list[int],
    causal: bool,
    device: torch.device,
) -> AttentionStep:
    """Metadata of one step from host lists (per request: its blocks, query and sequence length; per
    token: its slot), one host-to-device copy per tensor and no device sync."""
    query_start_loc = [0]
    for length in query_lens:
        query_start_loc.append(query_start_loc[-1] + length)
    return AttentionStep(
        backend=backend,
        block_table=block_table_tensor(block_ids, device),
        query_start_loc=to_device(query_start_loc, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        slot_mapping=to_device(slots, torch.int64, device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        causal=causal,
    )

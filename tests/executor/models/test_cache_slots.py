"""`cache_slots` (a range of positions' paged-cache slots, a range per block) equals `cache_slot` position by
position: within a block, across blocks, from the middle of a block, and past the request's blocks (-1); host lists
become the tensors torch.tensor would make."""

from __future__ import annotations

import random

import pytest
import torch

from executor_service.models.attention_step import cache_slot, cache_slots, host_tensor


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cache_slots_equal_cache_slot_per_position(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(200):
        blocks = rng.sample(range(64), rng.randint(0, 6))
        start = rng.randint(0, 8 * block_size)
        stop = start + rng.randint(0, 5 * block_size)
        expected = [cache_slot(blocks, p, block_size) for p in range(start, stop)]
        assert cache_slots(blocks, start, stop, block_size) == expected, (blocks, start, stop)


def test_a_range_past_the_blocks_is_written_nowhere() -> None:
    assert cache_slots([3, 1], 2, 10, 4) == [14, 15, 4, 5, 6, 7, -1, -1]
    assert cache_slots([], 0, 2, 4) == [-1, -1]
    assert cache_slots([5], 2, 2, 4) == []


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([3, -1, 2**40], torch.int64),
        ([[1, 2], [3, 4]], torch.int32),
        ([0.5, -1.25], torch.float32),
        ([True, False], torch.bool),
        ([], torch.int64),
        ([1.5, 2.0], torch.bfloat16),  # no numpy dtype: torch.tensor's own way
    ],
)
def test_host_tensor_is_torch_tensor(values: list, dtype: torch.dtype) -> None:
    """The host lists' way to a tensor (through numpy, faster) gives torch.tensor's tensor."""
    found, wanted = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert found.dtype == wanted.dtype and found.shape == wanted.shape and torch.equal(found, wanted)

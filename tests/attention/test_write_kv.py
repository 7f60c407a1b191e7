"""The KV writer's Triton kernel (under the interpreter on the CPU, or on the GPU) against an independent
reference: a loop that puts each token's keys and values at its slot. Slot mappings may be views with a
stride (a column of the drafter's slots-ahead table), as the speculative step's chain passes them."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import kv_cache

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS, BLOCK_SIZE, HEADS, DIM = 6, 4, 2, 8


def reference(k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    for token, slot in enumerate(slots):
        if slot >= 0:
            k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[token]
            v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[token]
    return k_cache, v_cache


@pytest.mark.parametrize("strided", [False, True])
def test_triton_writer_puts_each_token_at_its_slot(strided: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    slots = [5, -1, 17, 0, 23]
    k, v = torch.randn(2, len(slots), HEADS, DIM, generator=generator)
    table = torch.full((len(slots), 3), 99, dtype=torch.int64, device=DEVICE)  # the writer must read column 1 only
    table[:, 1] = torch.tensor(slots)
    slot_mapping = table[:, 1] if strided else table[:, 1].contiguous()
    assert slot_mapping.is_contiguous() != strided
    k_cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kv_cache._triton_writer()(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slot_mapping)
    expected_k, expected_v = reference(k, v, slots)
    torch.testing.assert_close(k_cache.cpu(), expected_k)
    torch.testing.assert_close(v_cache.cpu(), expected_v)

"""RoPE and the KV write fused (executor_service/models/rotary_cache.py), under the interpreter on the CPU or on the
GPU, against an independent reference: Hugging Face's rotate-half rotation in torch and a loop that puts each
token's key and value at its slot. q, k, v are views of one fused projection, as in the model."""

from __future__ import annotations

import os

import pytest
import torch

from executor_service.models import rotary_cache

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS, Q_HEADS, KV_HEADS, DIM, BLOCKS, BLOCK_SIZE = 5, 4, 2, 16, 4, 4


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float().repeat(1, 1, 2), sin.float().repeat(1, 1, 2)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("q_heads", [Q_HEADS, 0], ids=["attention", "keys and values only (DFlash's context)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotates_q_and_stores_rotated_k_and_v_at_their_slots(dtype: torch.dtype, q_heads: int) -> None:
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(TOKENS, (q_heads + 2 * KV_HEADS) * DIM, generator=generator).to(dtype)
    angles = torch.rand(TOKENS, 1, DIM // 2, generator=generator) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = [3, -1, 12, 0, 15]
    q_ref, k_ref, v_ref = qkv.split([q_heads * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    expected_q = rotate_half(q_ref.reshape(TOKENS, q_heads, DIM), cos, sin)
    expected_k = rotate_half(k_ref.reshape(TOKENS, KV_HEADS, DIM), cos, sin)
    expected_caches = [torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=dtype) for _ in range(2)]
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_caches[0][slot // BLOCK_SIZE, slot % BLOCK_SIZE] = expected_k[token]
            expected_caches[1][slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v_ref.reshape(TOKENS, KV_HEADS, DIM)[token]

    fused = qkv.to(DEVICE)
    q, k, v = fused.split([q_heads * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    # Strided views of the projection, as in the model.
    q, k, v = (t.reshape(TOKENS, heads, DIM) for t, heads in zip((q, k, v), (q_heads, KV_HEADS, KV_HEADS), strict=True))
    k_cache, v_cache = (torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=dtype, device=DEVICE) for _ in range(2))
    slot_mapping = torch.tensor(slots, device=DEVICE)
    rotary_cache._kernel()(q, k, v, cos.to(DEVICE), sin.to(DEVICE), k_cache, v_cache, slot_mapping)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(q.cpu(), expected_q, **tolerance)
    torch.testing.assert_close(k_cache.cpu(), expected_caches[0], **tolerance)
    torch.testing.assert_close(v_cache.cpu(), expected_caches[1], rtol=0, atol=0)  # copied as it is

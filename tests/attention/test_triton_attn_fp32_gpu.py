"""TRITON_ATTN in float32 at head 128 (8B-shaped: 32 query heads, 8 KV heads, pages of 16) on the GPU.

The bf16-tuned prefill tiles needed 262656 bytes of shared memory in fp32, over an H100's 232448, and the
launch failed (tests/attention/test_triton_attn_config.py checks the arithmetic on the CPU). Here the real
kernels compile and run at the failing sizes: 2k-token prompts, 80-token suffixes over cached context,
decode and a 32-token verify (split-KV), plus head 256, against a float64 reference on the device.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE = torch.device("cuda")
CONTEXT = 2048
SPECS = {
    "prefill": BatchSpec("prefill_2k", (CONTEXT, CONTEXT - 7), (CONTEXT, CONTEXT - 7)),
    "suffix": BatchSpec("suffix_80", (CONTEXT + 80,) * 4, (80,) * 4),
    "decode": BatchSpec("decode", (CONTEXT + 81,) * 8, (1,) * 8),
    "verify": BatchSpec("verify_32", (CONTEXT + 112,) * 2, (32,) * 2),
}


def _reference(batch: PagedBatch) -> torch.Tensor:
    """Causal float64 attention from the contiguous keys/values, on the device (the CPU one is slow at 2k)."""
    q = batch.q.to(torch.float64)
    group = q.shape[1] // batch.keys[0].shape[1]
    out = torch.empty_like(q)
    start = 0
    for keys, values, query_len in zip(batch.keys, batch.values, batch.spec.query_lens, strict=True):
        seq_len = keys.shape[0]
        k = keys.to(DEVICE, torch.float64).repeat_interleave(group, dim=1)
        v = values.to(DEVICE, torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + query_len], k) * q.shape[-1] ** -0.5
        rows = torch.arange(query_len, device=DEVICE)[:, None] + (seq_len - query_len)
        scores = scores.masked_fill(torch.arange(seq_len, device=DEVICE)[None, :] > rows, float("-inf"))
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += query_len
    return out


@pytest.mark.parametrize(
    ("shape", "head_size"),
    [("prefill", 128), ("suffix", 128), ("decode", 128), ("verify", 128), ("prefill", 256), ("decode", 256)],
)
def test_fp32_triton_attn_at_8b_sizes(shape: str, head_size: int) -> None:
    spec = SPECS[shape]
    if head_size == 256 and shape == "prefill":  # one request keeps the head-256 case short
        spec = BatchSpec("prefill_2k_one", (CONTEXT,), (CONTEXT,))
    batch = make_paged_batch(spec, 32, 8, head_size, 16, torch.float32, DEVICE, seed=11)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        "TRITON_ATTN", batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, True, out=out, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), _reference(batch), atol=2e-4, rtol=2e-4)

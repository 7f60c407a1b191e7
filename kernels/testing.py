"""Paged attention batches for tests and benchmarks, and the float64 reference they are checked against.

A batch has shuffled physical blocks, block 0 left as a null block, and one block filled with NaN that
no request uses but every block-table row is padded with: a kernel that lets a key past a request's
length reach its output produces NaN. Keys and values are written through `write_kv`, so every test also
exercises the cache write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_cache import write_kv


@dataclass(frozen=True)
class BatchSpec:
    """Per request: total length (context + new tokens) and the number of new (query) tokens."""

    name: str
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.query_lens) or any(
            q < 0 or q > s for s, q in zip(self.seq_lens, self.query_lens, strict=True)
        ):
            raise ValueError(f"bad spec {self.name}")


# vLLM's backend-test batch specs (tests/v1/attention), plus DFlash blocks of 16 queries.
BATCH_SPECS = {
    spec.name: spec
    for spec in (
        BatchSpec("small_decode", (32, 40), (1, 1)),
        BatchSpec("small_prefill", (32, 40), (8, 8)),
        BatchSpec("mixed_small", (32, 40, 48, 56), (1, 1, 5, 5)),
        BatchSpec("medium_decode", (128, 256, 512, 1024, 128, 256, 512, 1024), (1,) * 8),
        BatchSpec("medium_prefill", (256, 512, 1024, 2048), (16, 16, 16, 16)),
        BatchSpec("mixed_medium", (512, 1024, 2048, 512, 1024, 2048), (1, 1, 1, 7, 7, 7)),
        BatchSpec("large_decode", (2048,) * 8, (1,) * 8),
        BatchSpec("large_prefill", (4096,) * 8, (32,) * 8),
        BatchSpec("single_decode", (1024,), (1,)),
        BatchSpec("single_prefill", (1024,), (64,)),
        BatchSpec("mixed_large", (1024, 2048, 4096, 1024, 2048, 4096), (1, 1, 1, 32, 32, 32)),
        BatchSpec("dflash_small", (17, 33, 80, 16 + 129), (16, 16, 16, 16)),
        BatchSpec("dflash", tuple(c + 16 for c in (1, 100, 1000, 2048, 4096, 8192)), (16,) * 6),
        BatchSpec("full_prefill", (300, 77), (300, 77)),
    )
}


@dataclass(frozen=True)
class PagedBatch:
    spec: BatchSpec
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per request, contiguous [S, Hkv, D], for the reference
    values: list[torch.Tensor]

    @property
    def max_query_len(self) -> int:
        return max(self.spec.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.spec.seq_lens, default=0)

    def kv_bytes(self) -> int:
        """Bytes of K and V the requests' attention must read at least once."""
        row = self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return 2 * row * sum(self.spec.seq_lens)

    def flops(self, causal: bool) -> float:
        """Matmul FLOPs (QK^T and PV) over the keys each query really sees."""
        heads, dim = self.q.shape[1], self.q.shape[2]
        seen = 0
        for s, n in zip(self.spec.seq_lens, self.spec.query_lens, strict=True):
            seen += n * (s - n) + n * (n + 1) // 2 if causal else n * s
        return 4.0 * heads * dim * seen


def make_paged_batch(
    spec: BatchSpec,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    poison: bool = True,
) -> PagedBatch:
    """Random q/k/v for `spec`, the keys and values written into a shuffled paged cache."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in spec.seq_lens]
    num_blocks = 2 + sum(blocks_per_seq)  # block 0: null; the last: poisoned, never referenced
    order = torch.randperm(num_blocks - 2, generator=gen) + 1
    max_blocks = max(blocks_per_seq, default=1)
    padding = num_blocks - 1 if poison else 0
    block_table = torch.full((len(spec.seq_lens), max(max_blocks, 1)), padding, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    if poison:
        k_cache[-1] = float("nan")
        v_cache[-1] = float("nan")
    keys, values, queries, slots = [], [], [], []
    used = 0
    for b, (seq_len, query_len) in enumerate(zip(spec.seq_lens, spec.query_lens, strict=True)):
        blocks = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_table[b, : len(blocks)] = blocks.int()
        positions = torch.arange(seq_len)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
        keys.append(torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype))
        queries.append(torch.randn(query_len, num_heads, head_size, generator=gen).to(dtype))
    lens = torch.tensor((0, *spec.query_lens))
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    if keys:
        write_kv(
            torch.cat(keys).to(device),
            torch.cat(values).to(device),
            k_cache,
            v_cache,
            torch.cat(slots).to(device=device, dtype=torch.int32),
        )
    return PagedBatch(
        spec=spec,
        q=torch.cat(queries).to(device)
        if queries
        else torch.empty(0, num_heads, head_size, dtype=dtype, device=device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        query_start_loc=torch.cumsum(lens, 0).to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(spec.seq_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def reference_attention(batch: PagedBatch, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Float64 attention straight from the contiguous per-request keys/values (no cache involved)."""
    q = batch.q.double().cpu()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    group = q.shape[1] // batch.keys[0].shape[1] if batch.keys else 1
    out = torch.empty_like(q)
    start = 0
    for keys, values, query_len in zip(batch.keys, batch.values, batch.spec.query_lens, strict=True):
        seq_len = keys.shape[0]
        k = keys.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + query_len], k) * scale
        if causal:
            visible = torch.arange(seq_len)[None, :] <= (seq_len - query_len) + torch.arange(query_len)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += query_len
    return out

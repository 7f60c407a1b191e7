"""FLASH_ATTN: the flash_attn package over our paged cache.

FA4 (`flash_attn.cute.flash_attn_varlen_func`, `page_table=`) on SM9x/SM10x; FA2
(`flash_attn.flash_attn_varlen_func`, `block_table=`, pages a multiple of 256 tokens) on SM8x and up.
Both align causal masks bottom-right, as our convention does. Unavailable when neither imports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import torch

from kernels.attention import AttentionBatch


@dataclass(frozen=True)
class FlashAttn:
    generation: int  # 2 or 4
    version: str
    varlen: Callable[..., object]


@functools.cache
def load() -> FlashAttn | None:
    """The best flash_attn generation that imports, or None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4

        return FlashAttn(4, _version("flash-attn-4", "flash_attn_4"), fa4)
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func as fa2

        return FlashAttn(2, _version("flash-attn", "flash_attn"), fa2)
    except ImportError:
        return None


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def library_version() -> str | None:
    """The loaded flash_attn's version, which narrows the capability entry (FA2 vs FA4)."""
    fa = load()
    return fa.version if fa else None


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip:
        return "flash_attn runs on NVIDIA GPUs only"
    fa = load()
    if fa is None:
        return "flash_attn not installed (neither flash_attn.cute (FA4) nor flash_attn 2.x imports)"
    major, _ = torch.cuda.get_device_capability(device)
    if fa.generation == 4 and major not in (9, 10):
        return f"FA4 needs compute capability 9.x or 10.x, this GPU is {major}.x"
    if fa.generation == 2 and major < 8:
        return f"FA2 needs compute capability 8.0 or newer, this GPU is {major}.x"
    return None


def forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, out: torch.Tensor | None
) -> torch.Tensor:
    fa = load()
    assert fa is not None, "checked by unavailable_reason"
    page_table = batch.block_table[: batch.num_requests]
    if fa.generation == 4:
        result, _lse = fa.varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=batch.query_start_loc,
            seqused_k=batch.seq_lens,
            page_table=page_table,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_seq_len,
            softmax_scale=batch.scale,
            causal=batch.causal,
        )
    else:
        if k_cache.shape[1] % 256:
            raise ValueError(f"FA2 paged attention needs pages of a multiple of 256 tokens, got {k_cache.shape[1]}")
        cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(batch.seq_lens, 0, dtype=torch.int32), (1, 0))
        result = fa.varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=batch.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_seq_len,
            softmax_scale=batch.scale,
            causal=batch.causal,
            block_table=page_table,
        )
    if out is None:
        return result
    out.copy_(result)
    return out

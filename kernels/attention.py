"""The one functional entry every attention backend implements, in the FlashAttention/vLLM conventions.

    paged_attention(backend, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, causal, scale=None)
      q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks] int32;
      query_start_loc [B+1] int32; seq_lens [B] int32 = context + query length.
      causal: query i of a request sees keys <= context_len + i (bottom-right aligned);
      non-causal: every query sees all seq_lens[b] keys of its request.        -> out [T, Hq, D]
      tree_mask (optional, causal only): [T] int64, each token's bits over its request's 64 newest keys,
      for tree drafting (kernels/tree_mask.py); -1 is plain causal.

Causality is an argument of every call (R9), so one backend serves causal target steps and non-causal
DFlash steps; a backend asked for what its capability entry does not claim fails with the reasons.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.capabilities import (
    BACKENDS,
    COMPUTE_CAPABILITY_NOT_SUPPORTED,
    PLATFORM_NOT_SUPPORTED,
    AttentionNeeds,
    BackendCapability,
    DType,
    Hardware,
    Platform,
)

# Backend name -> the module that implements `forward` and `unavailable_reason` for it.
IMPLEMENTATIONS = {
    "TRITON_ATTN": "kernels.triton_attn",
    "FLEX_ATTENTION": "kernels.flex_attn",
    "FLASH_ATTN": "kernels.flash_attn",
    "CPU_ATTN": "kernels.cpu_attn",
    "ROCM_ATTN": "kernels.rocm_attn",
}

TORCH_DTYPES = {torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16, torch.float32: DType.FLOAT32}


class BackendUnavailableError(RuntimeError):
    """The backend cannot run here (library missing, wrong device); the message says why."""


@dataclass(frozen=True)
class AttentionBatch:
    """The per-call metadata, checked once and handed to the backend's forward."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool
    scale: float
    max_query_len: int
    max_seq_len: int
    tree_mask: torch.Tensor | None = None  # [T] int64 (kernels/tree_mask.py); None: no tree

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]


def implementation(backend: str) -> ModuleType:
    """The module implementing `backend` (imported on first use, so optional libraries stay optional)."""
    name = backend.strip().upper()
    if name not in IMPLEMENTATIONS:
        known = ", ".join(IMPLEMENTATIONS)
        raise BackendUnavailableError(f"{name}: no implementation in this project (implemented: {known})")
    try:
        return importlib.import_module(IMPLEMENTATIONS[name])
    except ImportError as err:  # e.g. triton missing: the backend is unavailable, not broken
        raise BackendUnavailableError(f"{name}: {err}") from err


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device`, or None when it can."""
    try:
        return implementation(backend).unavailable_reason(device)
    except BackendUnavailableError as err:
        return str(err)


def paged_attention(
    backend: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over the paged cache; see the module docstring for the conventions.

    `out` (optional) receives the result; `max_query_len` / `max_seq_len` are host-side bounds that
    spare a device sync when the caller knows them (the executor does). `tree_mask`: tree attention.
    """
    name = backend.strip().upper()
    _check_shapes(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, out)
    check_tree_mask(tree_mask, q, causal)
    module = implementation(name)
    check_claimed(name, q, k_cache, causal, tree=tree_mask is not None)
    reason = module.unavailable_reason(q.device)
    if reason is not None:
        raise BackendUnavailableError(f"{name} cannot run on {q.device}: {reason}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if seq_lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    batch = AttentionBatch(
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        causal=causal,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        tree_mask=tree_mask,
    )
    return module.forward(q, k_cache, v_cache, batch, out)


def check_tree_mask(tree_mask: torch.Tensor | None, q: torch.Tensor, causal: bool) -> None:
    """A tree mask narrows causal attention: one int64 per query token, on q's device."""
    if tree_mask is None:
        return
    if not causal:
        raise ValueError("a tree mask narrows causal attention; it cannot go with causal=False")
    if tree_mask.dtype != torch.int64 or tree_mask.shape != (q.shape[0],) or tree_mask.device != q.device:
        raise ValueError(
            f"tree_mask must be int64 [{q.shape[0]}] on {q.device}; got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)} on {tree_mask.device}"
        )


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k_cache == v_cache [blocks, block_size, Hkv, D]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_size or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of {head_size}; the cache has {num_kv_heads} of {k_cache.shape[3]}")
    for label, tensor in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{label} must be int32, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{label} is on {tensor.device}, q on {q.device}")
    batch = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] < batch or query_start_loc.shape != (batch + 1,):
        raise ValueError(
            f"for {batch} requests: block_table [>= {batch}, max_blocks], query_start_loc [{batch + 1}]; got "
            f"{tuple(block_table.shape)} and {tuple(query_start_loc.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must match q {tuple(q.shape)} {q.dtype}; got {tuple(out.shape)} {out.dtype}")


def check_claimed(backend: str, q: torch.Tensor, k_cache: torch.Tensor, causal: bool, tree: bool = False) -> None:
    """ValueError with the table's reasons unless the capability entry claims this call (R9, R11)."""
    reasons = refusal_reasons(backend, q, k_cache, causal, tree)
    if reasons:
        raise ValueError(f"{backend.strip().upper()} cannot run this call: {reasons}")


def refusal_reasons(
    backend: str, q: torch.Tensor, k_cache: torch.Tensor, causal: bool, tree: bool = False
) -> list[str]:
    """Why the capability table refuses this call on this device (R9); empty when it claims it.

    The platform is not checked: kernels run wherever they can (ROCM_ATTN is tested on CUDA, CPU_ATTN is
    the reference on GPUs); the selector keeps each platform to its own backends.
    """
    return layer_refusal_reasons(backend, q.dtype, q.shape[-1], k_cache.shape[1], q.device, causal, tree)


def layer_refusal_reasons(
    backend: str,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    device: torch.device,
    causal: bool = True,
    tree: bool = False,
) -> list[str]:
    """refusal_reasons before any tensor exists, from a layer's shapes: a load checks its backends with it, so
    one the kernels would refuse at every step fails the load instead. BackendUnavailableError: no module."""
    name = backend.strip().upper()
    module = implementation(name)
    version = getattr(module, "library_version", lambda: None)()
    return list(_refusal_reasons(BACKENDS[name], version, dtype, head_size, block_size, causal, device, tree))


@functools.lru_cache(maxsize=256)
def _refusal_reasons(
    capability: BackendCapability,
    version: str | None,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    causal: bool,
    device: torch.device,
    tree: bool = False,
) -> tuple[str, ...]:
    """Cached: a model's layers ask the same question every step, and the answer never changes."""
    table_dtype = TORCH_DTYPES.get(dtype)
    needs = AttentionNeeds(
        head_size=head_size,
        dtype=table_dtype or DType.FLOAT32,
        block_size=block_size,
        use_non_causal=not causal,
        use_tree_attention=tree,
    )
    hardware = Hardware(
        platform=_platform(device),
        compute_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0),
        gcn_arch="",
        libraries=((capability.required_library, version),) if version else (),
    )
    ignored = (PLATFORM_NOT_SUPPORTED, COMPUTE_CAPABILITY_NOT_SUPPORTED)  # unavailable_reason's business
    reasons = [r for r in capability.validate(needs, hardware) if r not in ignored and not r.endswith(" not installed")]
    if table_dtype is None:
        reasons.insert(0, "dtype not supported")
    return tuple(reasons)


def _platform(device: torch.device) -> Platform:
    if device.type == "cuda":
        return Platform.ROCM if torch.version.hip else Platform.CUDA
    return Platform.CPU

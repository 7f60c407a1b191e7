"""RoPE and the KV-cache write of one layer as one kernel on GPUs.

Every layer rotates q and k, then stores k and v at their slots of the paged cache: two kernels, each reading
k. On a small model's decode step those launches are a good part of the layer (SmolLM2: 30 layers of about ten
kernels each). One Triton program per (token, head) does both: a query head is rotated in place; a KV head is
rotated and written straight into the cache, with its value head (k itself is not written back: attention
reads keys from the cache). Tokens whose slot is -1 store nothing. On the CPU, or for layouts the kernel does
not take, the two steps run as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from executor_service.models.rope import apply_rotary
from kernels import write_kv


def rotate_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """q [T, Hq, D] rotated (in place on GPUs), and k [T, Hkv, D] rotated and stored with v at `slot_mapping` in
    k_cache, v_cache [blocks, block_size, Hkv, D]; cos, sin [T, 1, D/2]. Returns the rotated q."""
    fused = q.is_cuda and all(t.stride(-1) == 1 for t in (q, k, v, k_cache)) and k_cache.stride() == v_cache.stride()
    if not fused or q.shape[0] == 0:
        q, k = apply_rotary(q, k, cos, sin)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    _kernel()(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return q


@functools.cache
def _kernel() -> Callable[..., None]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["slot_ptr"])  # a slot mapping sliced at an odd row: no second compile
    def rotary_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_slot,
        stride_cb, stride_cs, stride_ch, block_size,
        NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        cos = tl.load(cos_ptr + token * stride_ct + offs, mask=mask).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_ct + offs, mask=mask).to(tl.float32)
        if head < NUM_Q_HEADS:
            base = q_ptr + token * stride_qt + head * stride_qh
            x1 = tl.load(base + offs, mask=mask).to(tl.float32)
            x2 = tl.load(base + HALF + offs, mask=mask).to(tl.float32)
            tl.store(base + offs, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
            tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)
        else:
            kv_head = head - NUM_Q_HEADS
            slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
            if slot >= 0:
                key = k_ptr + token * stride_kt + kv_head * stride_kh
                value = v_ptr + token * stride_vt + kv_head * stride_vh
                dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + kv_head * stride_ch
                x1 = tl.load(key + offs, mask=mask).to(tl.float32)
                x2 = tl.load(key + HALF + offs, mask=mask).to(tl.float32)
                # Rounded to k's dtype first, as the rotation in place would, then to the cache's.
                k1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
                k2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
                tl.store(k_cache_ptr + dst + offs, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_cache_ptr + dst + HALF + offs, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                v1 = tl.load(value + offs, mask=mask)
                v2 = tl.load(value + HALF + offs, mask=mask)
                tl.store(v_cache_ptr + dst + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_cache_ptr + dst + HALF + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)

    def launch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:  # type: ignore[no-untyped-def]
        tokens, num_q_heads, head_size = q.shape
        half = head_size // 2
        rotary_store_kernel[(tokens, num_q_heads + k.shape[1])](
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            slot_mapping.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
            NUM_Q_HEADS=num_q_heads, HALF=half, BLOCK=triton.next_power_of_2(half),
        )  # fmt: skip

    launch.jit = rotary_store_kernel  # type: ignore[attr-defined]  # what it compiles (tests read its flags)
    return launch

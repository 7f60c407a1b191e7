"""Writing new keys and values into the paged cache: slot = block * block_size + offset; -1 skips."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at their slots of k_cache, v_cache [num_blocks, block_size, Hkv, D].

    Tokens whose slot is -1 (padding, rejected drafts) are skipped. On GPUs a Triton kernel does it with
    no host sync (CUDA-graph safe); on the CPU a masked copy.
    """
    if k.shape != v.shape or k.dim() != 3 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"k, v [T, Hkv, D] with slot_mapping [T]; got {tuple(k.shape)}, {tuple(slot_mapping.shape)}")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold k {tuple(k.shape)}")
    if k.shape[0] == 0:
        return
    if k.device.type == "cpu":
        _write_masked(k, k_cache, slot_mapping)
        _write_masked(v, v_cache, slot_mapping)
    else:
        _triton_writer()(k, v, k_cache, v_cache, slot_mapping)


def _write_masked(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = x[keep].to(cache.dtype)


@functools.cache
def _triton_writer() -> Callable[..., None]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["slot_ptr"])  # a slot mapping sliced at an odd row: no second compile
    def write_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_slot,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_cs, stride_ch,
        block_size, num_kv_heads, head_size,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
        if slot < 0:
            return
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_size)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    def write(k, v, k_cache, v_cache, slot_mapping) -> None:
        if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
            raise ValueError("write_kv needs the head dimension contiguous and k/v caches of one layout")
        num_kv_heads, head_size = k.shape[1], k.shape[2]
        write_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping, slot_mapping.stride(0),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1], num_kv_heads, head_size,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_size),
        )  # fmt: skip

    write.jit = write_kernel  # type: ignore[attr-defined]  # what it compiles (tests read its flags)
    return write

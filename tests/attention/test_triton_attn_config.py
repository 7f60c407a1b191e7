"""TRITON_ATTN's launch configs fit shared memory for every (dtype, head size) its capability entry claims.

No GPU needed: the configs and the shared-memory estimate are plain arithmetic (ROCM_ATTN's key tile too).
The estimate is checked against what Triton 3.9 allocated for the kernels, compiled offline for sm_90, sm_80
and gfx942: an fp32 prefill at head 128 in the bf16-tuned tiles asked for 262656 bytes, more than an H100's
232448 (the bug this guards against), and 196608 on an MI300, whose LDS holds 65536.
"""

from __future__ import annotations

import pytest
import torch

from kernels.capabilities import DType, get_backend
from kernels.triton_attn_config import (
    A100_SHARED_MEMORY,
    FALLBACK_SHARED_MEMORY,
    H100_SHARED_MEMORY,
    LaunchConfig,
    choose_config,
    fit_shared_memory,
    shared_memory_bytes,
    shared_memory_limit,
    split_count,
)

CPU = torch.device("cpu")
ITEMSIZE = {DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4}
# (limit, ROCm's allocation): an MI300's LDS is 64 KiB, what ROCm's torch falls back to.
LIMITS = {"h100": (H100_SHARED_MEMORY, False), "a100": (A100_SHARED_MEMORY, False), "mi300": (65536, True)}
# (num_requests, max_query_len, max_seq_len) at 8 KV heads, group 4: prefill of a 2k prompt, an 80-token
# suffix over cached context, decode (split and not), a 32-token verify (128 rows, split-KV, one tile).
SHAPES = {
    "prefill": (2, 2048, 2048),
    "suffix": (4, 80, 2128),
    "decode": (1, 1, 4096),
    "decode_full": (256, 1, 4096),
    "verify": (1, 32, 4096),
}
# Triton 3.9's `shared` (triton.compile to GPUTarget("cuda", cc, 32), causal; the configs before and after
# the fix): (cc, dtype bytes, head, block_m, block_n, num_warps, num_stages, split, tree) -> bytes.
MEASURED = {
    (90, 4, 128, 128, 128, 8, 3, False, False): 262656,  # the failing fp32 prefill
    (90, 4, 128, 128, 64, 8, 3, False, False): 164608,
    (90, 4, 128, 128, 64, 8, 2, False, False): 164352,
    (90, 4, 128, 16, 64, 4, 3, True, False): 78144,
    (90, 4, 128, 128, 64, 4, 3, True, True): 164608,
    (90, 4, 256, 64, 64, 8, 2, False, False): 213248,
    (90, 4, 256, 16, 32, 4, 3, True, False): 84160,
    (90, 4, 256, 128, 16, 4, 3, True, True): 172548,
    (90, 2, 128, 128, 128, 8, 3, False, False): 98304,
    (80, 2, 128, 128, 128, 8, 3, False, False): 65536,
    (80, 4, 128, 128, 32, 8, 3, False, False): 115328,
    (80, 4, 256, 64, 16, 4, 2, True, True): 102656,
}
# The same for gfx942 (GPUTarget("hip", "gfx942", 64)): the old fp32 tiles overflow its 64 KiB, the new fit.
MEASURED_GFX942 = {
    (4, 128, 128, 128, 8, 3, False, False): 196608,
    (4, 128, 128, 64, 8, 3, False, False): 98304,
    (4, 256, 64, 64, 8, 2, False, False): 147456,
    (4, 256, 16, 64, 4, 3, True, False): 135168,
    (4, 128, 128, 32, 8, 3, False, False): 65536,
    (4, 128, 16, 32, 4, 3, True, False): 34816,
    (4, 256, 64, 16, 8, 2, False, False): 65536,
    (4, 256, 16, 16, 4, 3, True, False): 33792,
    (4, 256, 64, 16, 4, 2, True, True): 65536,
    (2, 128, 128, 128, 8, 3, False, False): 32768,
    (2, 256, 128, 64, 4, 3, True, False): 65536,
    (2, 256, 16, 64, 4, 3, True, False): 32768,
}


def _claimed_head_pads() -> list[int]:
    """The padded head sizes (what the kernel tiles) of every head size TRITON_ATTN's entry accepts."""
    rule = get_backend("TRITON_ATTN").head_sizes
    return sorted({max(16, 1 << (h - 1).bit_length()) for h in range(1, 1025) if rule.accepts(h)})


def test_claimed_head_sizes_are_known() -> None:
    assert _claimed_head_pads() == [32, 64, 128, 256]
    assert DType.FLOAT32 in get_backend("TRITON_ATTN").dtypes


@pytest.mark.parametrize("key", sorted(MEASURED), ids=str)
def test_estimate_bounds_what_triton_allocated(key: tuple) -> None:
    _, itemsize, head, block_m, block_n, warps, stages, split, _ = key
    cfg = LaunchConfig(block_m, block_n, 8 if split else 1, warps, stages)
    assert shared_memory_bytes(cfg, head, itemsize) >= MEASURED[key]


@pytest.mark.parametrize("key", sorted(MEASURED_GFX942), ids=str)
def test_hip_estimate_bounds_what_triton_allocated(key: tuple) -> None:
    itemsize, head, block_m, block_n, warps, stages, split, _ = key
    cfg = LaunchConfig(block_m, block_n, 8 if split else 1, warps, stages)
    assert shared_memory_bytes(cfg, head, itemsize, hip=True) >= MEASURED_GFX942[key]
    if itemsize == 4:  # exact in fp32
        assert shared_memory_bytes(cfg, head, itemsize, hip=True) == MEASURED_GFX942[key]


def test_estimate_is_exact_at_two_stages_fp32() -> None:
    assert shared_memory_bytes(LaunchConfig(128, 64, 1, 8, 2), 128, 4) == 164352
    assert shared_memory_bytes(LaunchConfig(64, 64, 1, 8, 2), 256, 4) == 213248
    assert shared_memory_bytes(LaunchConfig(64, 16, 8, 4, 2), 256, 4) == 102656


def test_bf16_tuned_prefill_tiles_overflow_fp32_on_h100() -> None:
    """The config that failed on the H100 is flagged by the estimate."""
    assert shared_memory_bytes(LaunchConfig(128, 128, 1, 8, 3), 128, 4) > H100_SHARED_MEMORY


@pytest.mark.parametrize("gpu", sorted(LIMITS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_every_claimed_config_fits(dtype: DType, shape: str, gpu: str) -> None:
    num_requests, max_query_len, max_seq_len = SHAPES[shape]
    for head_pad in _claimed_head_pads():
        limit, hip = LIMITS[gpu]
        cfg = choose_config(num_requests, 8, 4, max_query_len, max_seq_len, head_pad, CPU, ITEMSIZE[dtype], limit, hip)
        used = shared_memory_bytes(cfg, head_pad, ITEMSIZE[dtype], hip)
        assert used <= limit, f"{dtype} head {head_pad} {shape} on {gpu}: {cfg} needs {used} bytes"
        if cfg.num_splits > 1:  # split-KV keeps a request's rows in one tile
            assert cfg.block_m >= max_query_len * 4


@pytest.mark.parametrize("gpu", ["h100", "mi300"])
@pytest.mark.parametrize("head_pad", [32, 64, 128, 256])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_half_precision_configs_unchanged(shape: str, head_pad: int, gpu: str) -> None:
    """bf16/fp16 (the fast path) keep the tiles they were tuned with: they fit without shrinking."""
    num_requests, max_query_len, max_seq_len = SHAPES[shape]
    limit, hip = LIMITS[gpu]
    fitted = choose_config(num_requests, 8, 4, max_query_len, max_seq_len, head_pad, CPU, 2, limit, hip)
    unbounded = choose_config(num_requests, 8, 4, max_query_len, max_seq_len, head_pad, CPU, 2, 1 << 30, hip)
    assert fitted == unbounded


def test_fp32_head_128_prefill_shrinks_on_h100() -> None:
    cfg = choose_config(2, 8, 4, 2048, 2048, 128, CPU, 4, H100_SHARED_MEMORY)
    assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, 64, 3)


def test_fit_gives_up_splitting_before_failing() -> None:
    """Rows that cannot share one tile under the limit drop split-KV rather than overflow."""
    cfg = fit_shared_memory(LaunchConfig(128, 64, 8, 4, 3), 256, 4, 64 * 1024, min_block_m=128)
    assert cfg.num_splits == 1
    assert shared_memory_bytes(cfg, 256, 4) <= 64 * 1024


def test_fit_refuses_a_limit_nothing_fits() -> None:
    with pytest.raises(ValueError, match="shared memory"):
        fit_shared_memory(LaunchConfig(128, 64, 1, 4, 3), 256, 4, 1024, min_block_m=16)


def test_cpu_uses_the_h100_limit() -> None:
    assert shared_memory_limit(CPU) == H100_SHARED_MEMORY


@pytest.mark.parametrize(
    ("head", "itemsize", "hip", "limit", "expected"),
    [
        (128, 4, True, FALLBACK_SHARED_MEMORY, 32),  # 64 keys: 81920 bytes on gfx942, over its 64 KiB
        (256, 4, True, FALLBACK_SHARED_MEMORY, 16),  # 32 keys: 73728
        (64, 4, True, FALLBACK_SHARED_MEMORY, 64),
        (256, 2, True, FALLBACK_SHARED_MEMORY, 64),  # bf16 unchanged
        (128, 4, False, H100_SHARED_MEMORY, 64),  # what the CPU (interpreter) runs, as before
        (256, 4, False, H100_SHARED_MEMORY, 32),
    ],
)
def test_rocm_attn_key_tile_fits(
    monkeypatch: pytest.MonkeyPatch, head: int, itemsize: int, hip: bool, limit: int, expected: int
) -> None:
    from kernels import rocm_attn

    monkeypatch.setattr(rocm_attn, "is_hip", lambda device: hip)
    monkeypatch.setattr(rocm_attn, "shared_memory_limit", lambda device: limit)
    assert rocm_attn._block_n(head, itemsize, CPU) == expected


def test_device_limit_from_torch_then_triton_then_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import triton

    from kernels import triton_attn_config

    def driver(limit: int | None) -> SimpleNamespace:
        def properties(index: int) -> dict:
            if limit is None:
                raise RuntimeError("no driver")
            return {"max_shared_mem": limit}

        return SimpleNamespace(active=SimpleNamespace(utils=SimpleNamespace(get_device_properties=properties)))

    for props, triton_limit, expected in [
        (SimpleNamespace(shared_memory_per_block_optin=H100_SHARED_MEMORY), 1, H100_SHARED_MEMORY),
        (SimpleNamespace(), 160 * 1024, 160 * 1024),  # ROCm's torch: Triton's figure (a gfx950)
        (SimpleNamespace(), None, FALLBACK_SHARED_MEMORY),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        monkeypatch.setattr(triton.runtime, "driver", driver(triton_limit))
        triton_attn_config._device_shared_memory.cache_clear()
        assert triton_attn_config.shared_memory_limit(torch.device("cuda", 0)) == expected
    triton_attn_config._device_shared_memory.cache_clear()


def test_split_count_fills_the_gpu_and_no_more() -> None:
    """An 8B model's decode on a 132-SM GPU: batch 32 at tensor parallelism 2 (4 KV heads, 128 programs) already
    fills it, so no split, whatever the context a CUDA graph is launched for; batch 1 splits a long context as it
    needs, batch 2 launches only the programs that fill the GPU over the splits its keys need; batch 8 (64
    programs, half the SMs) does not split. A split is always MAX_SPLITS (one compile), with as many programs as
    the longest context's parts need."""
    assert split_count(32 * 4, 132, 8192) == (1, 1)
    assert split_count(32 * 8, 132, 8192) == (1, 1)
    assert split_count(1 * 8, 132, 8192) == (16, 16)
    assert split_count(1 * 8, 132, 300) == (16, 4)
    assert split_count(1 * 8, 132, 129) == (16, 2)
    assert split_count(2 * 8, 132, 8192) == (16, 8)
    assert split_count(2 * 8, 132, 100) == (1, 1)
    assert split_count(8 * 8, 132, 8192) == (1, 1)

"""TRITON_ATTN launch configurations: tile sizes and split count, bounded by the device's shared memory.

Why a bound: Triton stages the key loop's K and V tiles in shared memory (num_stages - 1 copies of each in
flight), and a launch that needs more than the device allows fails at compile time with OutOfResources. The
tiles were tuned for bf16 at head 128; fp32 doubles their bytes and head 256 doubles them again (an fp32
prefill at head 128 asked an H100 for 262656 bytes of 232448). So the heuristic's pick is shrunk, key tile
first, then pipeline stages, then query tile, until `shared_memory_bytes` fits the device's limit.

Torch-light on purpose: only the device limit reads torch, so tests check every claimed (dtype, head size)
against the H100 and A100 limits without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

# Split-KV: a request's keys go to at most MAX_SPLITS programs per head, each given at least MIN_SPLIT_LEN keys
# (fewer, longer splits for short contexts: every split costs a partial write and a share of the combine).
MAX_SPLITS = 16
MIN_SPLIT_LEN = 128
MIN_FILL = 4  # split only when the unsplit programs would fill at most a quarter of the SMs

# Shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes.
H100_SHARED_MEMORY = 232448  # 227 KiB
A100_SHARED_MEMORY = 166912  # 163 KiB
# When neither torch nor Triton reports it: an MI300's LDS, and below every CUDA GPU of compute capability
# 7.0 and up, so a config that fits it fits them all.
FALLBACK_SHARED_MEMORY = 65536
MIN_BLOCK = 16  # tl.dot's smallest tile side


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    # Pack a KV head's query heads into one tile's rows, so they share K/V loads. Tiles of one head
    # (False) hold 4x more query positions, shrinking the masked causal diagonal's share, but on an H100
    # 4k causal prefill ran 0.428 ms unpacked vs 0.393 ms packed: the extra K/V reads cost more.
    pack_gqa: bool = True
    min_split_len: int = MIN_SPLIT_LEN  # tests lower it to split short contexts
    split_programs: int | None = None  # programs launched over the splits (None: one per split)


def shared_memory_bytes(cfg: LaunchConfig, head_pad: int, itemsize: int, hip: bool = False) -> int:
    """An upper bound on the kernel's shared memory, in the terms Triton allocates it. CUDA: the K and V
    tiles of every pipeline stage but the one being computed, the Q tile (staged for the dot's operand
    layout), the P tile when fp32 dots run on FMA units (both operands go through shared memory), and one
    float per row for the row max/sum; equal to what Triton 3.9 allocates for sm_90 fp32 at 2 stages, above
    it otherwise. ROCm (LDS): one K and one V tile whatever the stages, plus the fp32 P tile, or the Q tile
    before the loop if larger; equal to Triton 3.9's gfx942 figures in fp32, above them in bf16."""
    p = cfg.block_m * cfg.block_n * 4 if itemsize == 4 else 0
    if hip:
        return max(2 * cfg.block_n * head_pad * itemsize + p, cfg.block_m * head_pad * itemsize)
    kv = max(1, cfg.num_stages - 1) * 2 * cfg.block_n * head_pad * itemsize
    q = cfg.block_m * head_pad * itemsize
    return kv + q + p + cfg.block_m * 4


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _device_shared_memory(device_index: int) -> int:
    """torch's opt-in figure, else the one Triton's launcher checks against (ROCm's torch has none)."""
    limit = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)
    if not limit:
        try:
            import triton

            limit = triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
        except Exception:  # an older or different driver API: the safe fallback below
            limit = 0
    return limit or FALLBACK_SHARED_MEMORY


def is_hip(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def shared_memory_limit(device: torch.device) -> int:
    """The device's limit; on the CPU (the interpreter, which has none) the H100's, so tests run its configs."""
    if device.type == "cuda":
        return _device_shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    return H100_SHARED_MEMORY


def fit_shared_memory(
    cfg: LaunchConfig, head_pad: int, itemsize: int, limit: int, min_block_m: int, hip: bool = False
) -> LaunchConfig:
    """Shrink `cfg` until it fits `limit`: the key tile first (the loop just takes more steps), then the
    pipeline stages, then the query tile down to `min_block_m` (split-KV needs a request's rows in one tile)."""
    while shared_memory_bytes(cfg, head_pad, itemsize, hip) > limit:
        if cfg.block_n > MIN_BLOCK:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_m > max(MIN_BLOCK, min_block_m):
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        elif cfg.num_splits > 1:  # the rows do not fit one tile: give up splitting, then shrink the tile
            cfg, min_block_m = replace(cfg, num_splits=1), MIN_BLOCK
        else:
            raise ValueError(
                f"TRITON_ATTN: no tile fits {limit} bytes of shared memory (head {head_pad}, {itemsize} B)"
            )
    return cfg


def split_count(programs: int, num_sms: int, max_seq_len: int) -> tuple[int, int]:
    """(key splits per (request, KV head), programs launched for them). Split: always MAX_SPLITS, the kernel's
    NUM_SPLITS (a constexpr: every other count would be another compile, met at run time by an eager pass whose
    longest context crosses a power of two: 0.8-1.2 s on an H200); the kernel cuts a request's keys into
    MAX_SPLITS parts of MIN_SPLIT_LEN keys or more, so a short context's parts past its keys are empty. The
    programs: as many as the longest request's keys need, no more than keep the GPU's SMs about full, each
    taking every n-th split when fewer than MAX_SPLITS (the kernel), so where a request's keys split does not
    depend on the launch. No split unless the programs leave most SMs idle (fewer than a MIN_FILL-th of them) and
    some key range needs two parts: a CUDA graph, launched for the longest context, writes and combines every
    split, the empty ones too. On 4x H200 at batch 32 (an 8B model, 200-token contexts) attention took 0.40 ms a
    step unsplit at 4 KV heads (128 programs) and 0.89 ms at 2 KV heads split over 16 (64 programs, 2 launched)."""
    fill = num_sms // max(1, programs)
    needed = min(MAX_SPLITS, -(-max_seq_len // MIN_SPLIT_LEN))
    if fill < MIN_FILL or needed == 1:
        return 1, 1
    return MAX_SPLITS, min(1 << (needed - 1).bit_length(), 1 << (fill.bit_length() - 1))


def choose_config(
    num_requests: int,
    num_kv_heads: int,
    group: int,
    max_query_len: int,
    max_seq_len: int,
    head_pad: int,
    device: torch.device,
    itemsize: int,
    limit: int | None = None,
    hip: bool | None = None,
) -> LaunchConfig:
    """Tile sizes and split count. Few queries per request (decode, DFlash, verify): one tile per
    request and enough key splits to fill the GPU; otherwise prefill tiles of 128 rows. Then shrunk to fit
    `limit` bytes of shared memory (default: the device's; `hip`: ROCm's allocation, default: the device's)."""
    limit = shared_memory_limit(device) if limit is None else limit
    hip = is_hip(device) if hip is None else hip
    rows = max_query_len * group
    num_sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    if rows <= 128:
        block_m = max(16, 1 << (rows - 1).bit_length())
        programs = max(1, num_requests * num_kv_heads)
        splits, split_programs = split_count(programs, num_sms, max_seq_len)
        cfg = LaunchConfig(block_m, 64, splits, 4, 3, split_programs=split_programs)
        return fit_shared_memory(cfg, head_pad, itemsize, limit, block_m if cfg.num_splits > 1 else MIN_BLOCK, hip)
    # Prefill: on an H100 (d=128, bf16) 128x128 tiles, 8 warps, 3 stages were fastest of the sweep.
    if head_pad <= 128:
        cfg = LaunchConfig(128, 128 if head_pad == 128 else 64, 1, 8 if head_pad == 128 else 4, 3)
    else:
        cfg = LaunchConfig(64, 64, 1, 8, 2)
    return fit_shared_memory(cfg, head_pad, itemsize, limit, MIN_BLOCK, hip)

"""FLEX_ATTENTION: torch flex_attention over the paged KV cache, its BlockMask built straight from the block table.

The cache is viewed as one long key sequence [1, Hkv, num_blocks * block_size, D] and the batch's new tokens as
one query sequence [1, Hq, T, D]. The BlockMask's KV block size is the cache block size, so each KV tile is one
physical cache block: per Q tile (Q_BLOCK tokens, possibly of several requests) the kernel visits only the blocks
those requests can see, and the padding block of block-table rows (which may hold NaN) is never loaded. mask_mod
maps (query token, physical slot) to (request, logical position) and applies the length and causal limits, so one
mask_mod serves causal target steps and bidirectional DFlash steps. Tree drafting adds per-token ancestor bitmasks
(kernels/tree_mask.py): mask_mod checks each key of the 64-key window against its token's bit, and no block that
holds window keys of a tree token counts as full.

The metadata depends only on the block table and lengths, not on the layer: an executor can build it once per step
(`build_flex_metadata`) and reuse it for every layer (`forward_with_metadata`). Building it never syncs the host.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBatch
from kernels.tree_mask import TREE_WINDOW, window_visible

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError as err:  # older torch: the backend reports itself unavailable
    _IMPORT_ERROR: str | None = f"torch {torch.__version__} has no flex_attention ({err})"
else:
    _IMPORT_ERROR = None

# Tokens per Q tile. 16 is the smallest tile tl.dot takes; a tile of decode tokens spans up to 16 requests and
# computes scores for all their blocks, so a larger tile would multiply the wasted work of decode batches.
Q_BLOCK = 16

# One compiled kernel per set of static shapes: padded tokens, requests, block-table width, cache size, dtype, heads.
# False: static shapes, the fastest kernels, but a compile for each new set (executors should pad to a few buckets);
# None lets dynamo switch the changing sizes to dynamic shapes after the first change (fewer compiles).
COMPILE_DYNAMIC: bool | None = False
# Dynamo's default of 8 compiled variants per function is soon spent by static shapes; past the limit fullgraph=True
# raises, where plain torch.compile would fall back to eager flex (every score materialised, NaN padding let in).
RECOMPILE_LIMIT = 256


def unavailable_reason(device: torch.device) -> str | None:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if device.type not in ("cpu", "cuda"):
        return f"flex_attention is wired up for cpu and cuda here, not {device.type}"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "compiled flex_attention needs triton, which is not installed"
    return None


@dataclass(frozen=True)
class FlexMetadata:
    """Everything flex_attention needs besides q/k/v; valid for every layer of one step."""

    block_mask: BlockMask
    num_tokens: int  # T, the real query tokens; queries are padded to a whole number of Q tiles
    padded_tokens: int
    # Eager flex (CPU) ignores the block lists and multiplies every value row by its weight; 0 * NaN = NaN, so the
    # eager path zeroes the value rows of slots no request uses. None when compiled: unlisted blocks are never read.
    used_slots: torch.Tensor | None


def build_flex_metadata(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool,
    num_blocks: int,
    block_size: int,
    num_tokens: int,
    tree_mask: torch.Tensor | None = None,
) -> FlexMetadata:
    """The BlockMask (partial and full block lists, mask_mod) for one step, built on the device without a sync.
    `tree_mask` [num_tokens] int64: tree attention (causal only)."""
    device = block_table.device
    num_reqs = seq_lens.shape[0]
    padded = max(1, -(-num_tokens // Q_BLOCK)) * Q_BLOCK
    starts = query_start_loc.long()
    tokens = torch.arange(padded, device=device)
    # Request of each token (empty requests own none); padding tokens get the sentinel request num_reqs.
    req = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)
    real = req < num_reqs
    seq = F.pad(seq_lens.long(), (0, 1))
    if causal:  # bottom-right aligned: query i of a request sees logical positions <= context_len + i
        query_lens = F.pad(starts[1:] - starts[:-1], (0, 1))
        last_visible = seq[req] - query_lens[req] + (tokens - starts[req])
    else:
        last_visible = seq[req] - 1
    last_visible = torch.where(real, last_visible, -1)  # [P]: the last logical key position each token sees
    full_limit = last_visible  # [P]: the last position up to which a token sees every key
    tree = None
    if tree_mask is not None:
        tree = F.pad(tree_mask, (0, padded - num_tokens), value=-1)
        window_start = seq[req] - TREE_WINDOW
        full_limit = torch.where(tree == -1, last_visible, torch.minimum(last_visible, window_start - 1))

    # int32 throughout: the [tokens, max_blocks] candidates below are the largest tensors built here.
    table = F.pad(block_table[:num_reqs], (0, 0, 0, 1))  # [B + 1, MB], sentinel row for padding tokens
    max_blocks = table.shape[1]
    block_start = torch.arange(max_blocks, device=device) * block_size  # logical position of each column
    # Column j of a token's row is visible if its first position is; this also drops blocks after a causal limit.
    visible = block_start <= last_visible[:, None]  # [P, MB]
    # A tile is full (no mask needed) when it holds tokens of one request only and its first token, which sees
    # the least, sees the whole block.
    first, last = tokens[::Q_BLOCK], tokens[Q_BLOCK - 1 :: Q_BLOCK]
    one_request = (req[first] == req[last]) & real[last]
    tile_limit = full_limit.view(-1, Q_BLOCK).min(dim=1).values  # causal: the first token's; trees: maybe lower
    full = one_request[:, None] & (block_start + block_size - 1 <= tile_limit[:, None])  # [nQ, MB]
    partial = visible & ~full.repeat_interleave(Q_BLOCK, dim=0)
    candidates = torch.where(partial, table[req], num_blocks).view(-1, Q_BLOCK * max_blocks)
    kv_num, kv_indices = _unique_rows(candidates, num_blocks)
    full_num, full_indices = _unique_rows(torch.where(full, table[req[first]], num_blocks), num_blocks)
    # The compiled CUDA kernel (torch 2.11) reads the full lists with the partial lists' layout: lists of
    # different widths gave wrong rows and illegal addresses on an H100. Pad both to one width.
    width = max(kv_indices.shape[-1], full_indices.shape[-1])
    kv_indices = F.pad(kv_indices, (0, width - kv_indices.shape[-1])).contiguous()
    full_indices = F.pad(full_indices, (0, width - full_indices.shape[-1])).contiguous()

    # Physical -> logical block per request; -1 where the request does not use the block (column num_blocks
    # soaks up the writes of table entries past a request's length, which may point anywhere).
    in_use = block_start < seq_lens.long()[:, None]  # [B, MB]
    p2l = torch.full((num_reqs + 1, num_blocks + 1), -1, dtype=torch.int32, device=device)
    columns = torch.where(in_use, table[:num_reqs].long(), num_blocks)
    logical = torch.arange(max_blocks, dtype=torch.int32, device=device).expand(num_reqs, max_blocks)
    p2l[:num_reqs].scatter_(1, columns, logical)

    used_slots = None
    if not _runs_compiled(device):
        slot = columns[:, :, None] * block_size + torch.arange(block_size, device=device)  # [B, MB, BS]
        live = (block_start[:, None] + torch.arange(block_size, device=device)) < seq_lens.long()[:, None, None]
        used_slots = torch.zeros(num_blocks * block_size + 1, dtype=torch.bool, device=device)
        used_slots[torch.where(live & in_use[:, :, None], slot, num_blocks * block_size).flatten()] = True
        used_slots = used_slots[:-1]

    block_mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=_paged_mask_mod(req, last_visible, p2l, block_size, tree, seq),
        seq_lengths=(padded, num_blocks * block_size),
        compute_q_blocks=False,  # the transposed lists serve only the backward pass
    )
    return FlexMetadata(block_mask, num_tokens, padded, used_slots)


def _unique_rows(rows: torch.Tensor, sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the distinct block ids (entries equal to `sentinel`, num_blocks, are empty), packed to the front.

    Sort, overwrite repeats with the sentinel, sort again: no host sync, unlike torch.unique per row. A row holds
    at most num_blocks distinct ids, so the lists are cut to that width (at least 1: the kernel reads entry 0).
    Returns kv_num_blocks [1, 1, rows] and kv_indices [1, 1, rows, width], both int32.
    """
    ids = F.pad(rows, (0, 1), value=sentinel).sort(dim=-1).values
    repeat = F.pad(ids[:, 1:] == ids[:, :-1], (1, 0))
    ids = ids.masked_fill(repeat, sentinel).sort(dim=-1).values[:, : max(1, min(rows.shape[1], sentinel))]
    counts = (ids != sentinel).sum(-1, dtype=torch.int32)
    return counts[None, None], ids.masked_fill(ids == sentinel, 0).int()[None, None].contiguous()


def _paged_mask_mod(
    req: torch.Tensor,
    last_visible: torch.Tensor,
    p2l: torch.Tensor,
    block_size: int,
    tree: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
) -> Callable[..., torch.Tensor]:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical_block = p2l[req[q_idx], kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (position <= last_visible[q_idx])

    if tree is None:
        return mask_mod
    assert seq is not None

    def tree_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical_block = p2l[req[q_idx], kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        visible = (logical_block >= 0) & (position <= last_visible[q_idx])
        return visible & window_visible(tree[q_idx], position, seq[req[q_idx]])

    return tree_mask_mod


def forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, out: torch.Tensor | None
) -> torch.Tensor:
    metadata = build_flex_metadata(
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        batch.causal,
        num_blocks=k_cache.shape[0],
        block_size=k_cache.shape[1],
        num_tokens=q.shape[0],
        tree_mask=batch.tree_mask,
    )
    return forward_with_metadata(q, k_cache, v_cache, metadata, batch.scale, out)


def forward_with_metadata(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: FlexMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache with prebuilt metadata; writes into `out` when given."""
    num_tokens = q.shape[0]
    out = torch.empty_like(q) if out is None else out
    num_blocks, block_size = k_cache.shape[:2]
    if metadata.num_tokens != num_tokens or metadata.block_mask.seq_lengths[1] != num_blocks * block_size:
        raise ValueError(
            f"metadata built for {metadata.num_tokens} tokens and {metadata.block_mask.seq_lengths[1]} cache slots; "
            f"got {num_tokens} tokens and {num_blocks * block_size} slots"
        )
    if num_tokens == 0:
        return out
    key, value = _as_sequence(k_cache, q.dtype), _as_sequence(v_cache, q.dtype)
    if metadata.used_slots is not None:
        value = value.masked_fill(~metadata.used_slots[:, None], 0)
    query = F.pad(q.transpose(0, 1).unsqueeze(0), (0, 0, 0, metadata.padded_tokens - num_tokens))
    if _runs_compiled(q.device):
        result = _compiled_flex()(
            query,
            key,
            value,
            block_mask=metadata.block_mask,
            scale=scale,
            enable_gqa=True,
            kernel_options=_kernel_options(block_size, q.shape[-1], q.element_size()),
        )
    else:  # eager flex: the dense math reference, fine for CPU batches of test size
        result = flex_attention(query, key, value, block_mask=metadata.block_mask, scale=scale, enable_gqa=True)
    out.copy_(result[0, :, :num_tokens].transpose(0, 1))
    return out


def _as_sequence(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> [1, Hkv, num_blocks * block_size, D]; a view unless the strides forbid."""
    num_blocks, block_size, heads, dim = cache.shape
    return cache.reshape(num_blocks * block_size, heads, dim).to(dtype).transpose(0, 1).unsqueeze(0)


def _kernel_options(block_size: int, head_size: int, element_size: int) -> dict[str, int | bool]:
    """Kernel tiles that divide the sparse blocks (flex requires it), and the main kernel for short query sequences
    too: flex_decoding, picked by default below 128 query rows, packs each GQA group into one query tile, a layout
    these block lists (one row per Q_BLOCK tokens) were not checked against."""
    block_n = block_size & -block_size  # largest power of two dividing block_size (>= 16: a multiple of 16)
    block_n = min(block_n, 64 if head_size * element_size <= 256 else 32)  # keep K/V tiles in shared memory
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK, "BLOCK_N": block_n}


def _runs_compiled(device: torch.device) -> bool:
    """Compiled (block-sparse Triton kernel) on GPUs; eager on CPU, where compiling each new shape costs seconds."""
    return device.type == "cuda"


_COMPILED: Callable[..., torch.Tensor] | None = None


def _compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process (and dynamo's recompile limits raised to RECOMPILE_LIMIT)."""
    global _COMPILED
    if _COMPILED is None:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
        _COMPILED = torch.compile(flex_attention, dynamic=COMPILE_DYNAMIC, fullgraph=True)
    return _COMPILED

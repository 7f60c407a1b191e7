"""TRITON_ATTN: our paged attention kernel (GQA, varlen, causal or not, split-KV for long contexts).

One kernel serves every call. A program owns up to BLOCK_Q new tokens of one request times all G query
heads of one KV head (BLOCK_M = BLOCK_Q * G rows), so the heads that share a KV head share its loads.
Programs map to (request, query tile) through a binary search over query_start_loc: no host sync.

Few queries per request over long contexts (decode, DFlash blocks, verification) would leave most SMs
idle, so each request's keys are split into NUM_SPLITS equal ranges whose partial results (normalised output and
log-sum-exp) a second kernel combines: flash-decoding. Keys every query of a tile sees run through an
unmasked loop; only the tail (the causal diagonal, the last partial tile) pays for masks.

Tree attention (TREE): each row also carries its token's tree mask, bits over its request's 64 newest keys
(kernels/tree_mask.py); those keys go through the masked loop, which drops the ones whose bit is clear.

Compiles: Triton compiles a kernel once per specialisation, its constexprs and whether each integer argument is 1
or a multiple of 16, and a compile stalls the step that meets it for 0.8-1.2 s (an H200). The batch, the block
table's width and the split buffers' strides change from step to step, so they are not specialised; the
constexprs take few values (triton_attn_config: four tile classes and the prefill tile, split or not), which the
executor compiles at load (executor_service/runner/eager_warm_up.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention import AttentionBatch
from kernels.pdl import wait_for_inputs
from kernels.triton_attn_config import MAX_SPLITS, LaunchConfig, choose_config

LOG2E = 1.4426950408889634


def unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs a CUDA/ROCm device (or TRITON_INTERPRET=1 on the CPU), got {device.type}"


@triton.jit
def find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """The request whose tiles contain `tile`: request b owns tiles from qsl[b] // BLOCK_Q + b on."""
    lo = 0
    hi = num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, k_base, v_base, block_table_row, stride_kb, stride_ks, offs_d, q_pos, tree_bits,
    start, end, kv_len, scale_log2, block_size,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, PAGE_ALIGNED: tl.constexpr, DOT_PRECISION: tl.constexpr, TREE: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [start, end). Unless MASKED, every row of the tile sees every key of the
    range, which lies below kv_len: the loads and scores then need no masks at all."""
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_SIZE
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        if PAGE_ALIGNED:  # the tile lies in one page: one block-table read
            block = tl.load(block_table_row + n0 // block_size).to(tl.int64)
        else:
            block = tl.load(block_table_row + pos // block_size, mask=pos < kv_len, other=0).to(tl.int64)
        rows = block * stride_kb + (pos % block_size) * stride_ks
        kv_ptrs = rows[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = (pos < kv_len)[:, None] & d_mask[None, :]
            k = tl.load(k_base + kv_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_base + kv_ptrs, mask=kv_mask, other=0.0)
        elif HEAD_SIZE == HEAD_PAD:
            k = tl.load(k_base + kv_ptrs)
            v = tl.load(v_base + kv_ptrs)
        else:
            k = tl.load(k_base + kv_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_base + kv_ptrs, mask=d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = (pos < kv_len)[None, :]
            if CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            if TREE:  # keys in the 64-key window: the row's bit for that key
                offset = pos[None, :] - (kv_len - 64)
                shift = tl.minimum(tl.maximum(offset, 0), 63).to(tl.int64)
                bit = (tree_bits[:, None] >> shift) & 1
                visible = visible & ((offset < 0) | (bit != 0))
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_requests", "stride_bt", "stride_split_o", "stride_split_lse"])  # Compiles, above
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr, tree_mask_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_bt, stride_split_o, stride_split_lse,
    num_requests, block_size, scale_log2,
    GROUP: tl.constexpr, ROW_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr, DOT_PRECISION: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
    TREE: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    if CAUSAL:  # the last tiles see the most keys: start them first so they do not trail the grid
        tile = tl.num_programs(0) - 1 - tile
    head_block = tl.program_id(1)  # ROW_GROUP query heads (all GROUP heads of a KV head, or just one)
    kv_head = head_block * ROW_GROUP // GROUP
    split = tl.program_id(2)  # the first of the key splits this program takes
    req = find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if local >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + req)
    context = kv_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local + offs_m // ROW_GROUP  # the request's new token of each row
    head = head_block * ROW_GROUP + offs_m % ROW_GROUP
    row_mask = (offs_m < BLOCK_Q * ROW_GROUP) & (q_idx < q_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = context + q_idx
    tree_bits = tl.full([BLOCK_M], -1, tl.int64)
    if TREE:
        tree_bits = tl.load(tree_mask_ptr + token, mask=row_mask, other=-1)

    # Keys this tile needs: all of the request (non-causal) or up to its last query's position.
    last_q = tl.minimum(local + BLOCK_Q, q_len) - 1
    kv_end = context + last_q + 1 if CAUSAL else kv_len
    all_visible = context + local + 1 if CAUSAL else kv_len  # keys every row of the tile sees
    if TREE:  # the window's keys depend on each row's mask
        all_visible = tl.maximum(tl.minimum(all_visible, kv_len - 64), 0)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_kh
    table = block_table_ptr + req.to(tl.int64) * stride_bt
    out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:  # MAX_SPLITS parts of this request's keys, at least MIN_SPLIT_LEN each: a function of the
        # request alone, so a CUDA graph (launched for its largest context) adds exactly what eager adds. A
        # launch of fewer programs than NUM_SPLITS has each take every n-th split; the splits stay the same.
        # The last term only matters when a launch has fewer splits than that needs (tests force it).
        split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_end, MAX_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT_LEN)
        split_len = tl.maximum(split_len, tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N)
        num_heads = tl.num_programs(1) * ROW_GROUP
        for part in range(split, NUM_SPLITS, tl.num_programs(2)):
            start = part * split_len
            end = tl.minimum(start + split_len, kv_end)
            acc, m_i, l_i = _attend_keys(
                q, k_base, v_base, table, stride_kb, stride_ks, offs_d, q_pos, tree_bits, start, end, all_visible,
                kv_len, scale_log2, block_size, BLOCK_M, CAUSAL, BLOCK_N, HEAD_SIZE, HEAD_PAD, PAGE_ALIGNED,
                DOT_PRECISION, TREE,
            )  # fmt: skip
            safe_l = tl.where(l_i > 0.0, l_i, 1.0)
            lse = tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("-inf"))
            tl.store(out_ptr + part * stride_split_o + out_offs, acc / safe_l[:, None], mask=out_mask)
            tl.store(lse_ptr + part * stride_split_lse + token * num_heads + head, lse, mask=row_mask)
    else:
        acc, m_i, l_i = _attend_keys(
            q, k_base, v_base, table, stride_kb, stride_ks, offs_d, q_pos, tree_bits, 0, kv_end, all_visible,
            kv_len, scale_log2, block_size, BLOCK_M, CAUSAL, BLOCK_N, HEAD_SIZE, HEAD_PAD, PAGE_ALIGNED,
            DOT_PRECISION, TREE,
        )  # fmt: skip
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(out_ptr + out_offs, (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _attend_keys(
    q, k_base, v_base, table, stride_kb, stride_ks, offs_d, q_pos, tree_bits, start, end, all_visible,
    kv_len, scale_log2, block_size, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_ALIGNED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TREE: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [start, end): the keys every row sees unmasked, the rest (the causal diagonal,
    a partial tile, a tree's window) masked. Unnormalised (acc, row max, row sum)."""
    unmasked_end = tl.maximum(tl.minimum(end, (all_visible // BLOCK_N) * BLOCK_N), start)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_base, v_base, table, stride_kb, stride_ks, offs_d, q_pos, tree_bits,
        start, unmasked_end, kv_len, scale_log2, block_size,
        False, CAUSAL, BLOCK_N, HEAD_SIZE, HEAD_PAD, PAGE_ALIGNED, DOT_PRECISION, TREE,
    )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_base, v_base, table, stride_kb, stride_ks, offs_d, q_pos, tree_bits,
        unmasked_end, end, kv_len, scale_log2, block_size,
        True, CAUSAL, BLOCK_N, HEAD_SIZE, HEAD_PAD, PAGE_ALIGNED, DOT_PRECISION, TREE,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_split_o", "stride_split_lse"])  # see Compiles, above
def _combine_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, num_heads, head_size,
    stride_split_o, stride_split_lse, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(lse_s - lse) * out_s with lse = log2 sum_s 2^lse_s; empty splits have lse -inf."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    row = token * num_heads + head
    lse = tl.load(lse_ptr + offs_s * stride_split_lse + row)
    lse_max = tl.max(lse, 0)
    weights = tl.math.exp2(lse - lse_max)
    weights = weights / tl.sum(weights, 0)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < head_size
    partial = tl.load(
        partial_ptr + offs_s[:, None] * stride_split_o + row * head_size + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )
    result = tl.sum(partial * weights[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    out: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """`config` overrides the heuristic (tests use it to force the split-KV path on small inputs)."""
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_size = q.shape
    if num_tokens == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("TRITON_ATTN needs the head dimension contiguous and k/v caches of one layout")
    cfg = config or choose_config(
        batch.num_requests,
        num_kv_heads,
        group,
        batch.max_query_len,
        batch.max_seq_len,
        head_pad,
        q.device,
        q.element_size(),
    )
    row_group = group if cfg.pack_gqa else 1
    block_q = max(1, cfg.block_m // row_group)
    block_m = triton.next_power_of_2(block_q * row_group)
    block_size = k_cache.shape[1]
    num_tiles = num_tokens // block_q + batch.num_requests
    if cfg.num_splits > 1 and block_q < batch.max_query_len:
        raise ValueError(f"split-KV needs each request's queries in one tile ({block_q} < {batch.max_query_len})")
    split = cfg.num_splits > 1
    if split:
        partial = torch.empty(cfg.num_splits, num_tokens, num_heads, head_size, dtype=torch.float32, device=q.device)
        lse = torch.empty(cfg.num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        target, lse_arg = partial, lse
        stride_split_o, stride_split_lse = partial.stride(0), lse.stride(0)
        stride_ot, stride_oh = partial.stride(1), partial.stride(2)
    else:
        target, lse_arg = out, out
        stride_split_o = stride_split_lse = 0
        stride_ot, stride_oh = out.stride(0), out.stride(1)
    tree = batch.tree_mask is not None
    if tree and not batch.causal:
        raise ValueError("TRITON_ATTN: a tree mask narrows causal attention")
    split_programs = min(cfg.num_splits, cfg.split_programs or cfg.num_splits)
    use_pdl = pdl.enabled(q.device)
    launch = pdl.launch_options(use_pdl)
    _paged_attention_kernel[(num_tiles, num_heads // row_group, split_programs)](
        q, k_cache, v_cache, target, lse_arg,
        batch.block_table, batch.query_start_loc, batch.seq_lens, batch.tree_mask if tree else batch.seq_lens,
        q.stride(0), q.stride(1), stride_ot, stride_oh,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        batch.block_table.stride(0), stride_split_o, stride_split_lse,
        batch.num_requests, block_size, batch.scale * LOG2E,
        GROUP=group, ROW_GROUP=row_group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        CAUSAL=batch.causal, SPLIT=split, PAGE_ALIGNED=block_size % cfg.block_n == 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MAX_SPLITS=MAX_SPLITS, MIN_SPLIT_LEN=cfg.min_split_len, TREE=tree, NUM_SPLITS=cfg.num_splits,
        PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )  # fmt: skip
    if split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            partial, lse, out, num_heads, head_size,
            partial.stride(0), lse.stride(0), out.stride(0), out.stride(1),
            NUM_SPLITS=cfg.num_splits, HEAD_PAD=head_pad, PDL=use_pdl, **launch,
        )  # fmt: skip
    return out

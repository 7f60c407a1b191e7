"""TRITON_ATTN's one-kernel split-KV combine on the GPU, where its programs really run at once: the counters'
atomics and the last program's reads of the others' partials (kernels/split_combine.py).

SmolLM2-135M's shape (9 query heads, 3 KV heads, head 64) and an 8B's (32, 8, 128), decode and 8-row verify, at
batch 1 (the heuristic's 16 splits for a graph's 8192-key bound) and 32 (splits forced, 4 programs taking 4 parts
each). Repeated calls give the same bits (the combine's order does not depend on which program arrives last) and
leave the counters zero; a captured graph replayed 50 times over changing sequence lengths (one part to sixteen)
matches the unsplit kernel run eagerly on the same lengths.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.attention import AttentionBatch, new_split_counters
from kernels.testing import BatchSpec, PagedBatch, make_paged_batch
from kernels.triton_attn_config import choose_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE = torch.device("cuda")
MAX_CONTEXT = 8192  # what a CUDA graph passes as max_seq_len
LONGEST = 2048  # 16 parts of 128 keys
SHAPES = {"smollm2": (9, 3, 64), "8b": (32, 8, 128)}
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-4}


def lengths(batch_size: int, query_len: int, seed: int) -> list[int]:
    """Sequence lengths from one part (a few keys) to every part (LONGEST): random, the first request's every
    part, one part or random as `seed` goes round, the second's (if any) one part."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(query_len, LONGEST + 1, (batch_size,), generator=gen).tolist()
    if seed % 3 < 2:
        values[0] = (LONGEST, query_len + 3)[seed % 3]
    if batch_size > 1:
        values[1] = query_len + 3
    return values


def setup(shape: str, dtype: torch.dtype, batch_size: int, query_len: int):
    heads, kv_heads, head_size = SHAPES[shape]
    spec = BatchSpec("stress", (LONGEST,) * batch_size, (query_len,) * batch_size)
    batch = make_paged_batch(spec, heads, kv_heads, head_size, 16, dtype, DEVICE, seed=3, poison=False)
    group, itemsize = heads // kv_heads, batch.q.element_size()
    cfg = choose_config(1, kv_heads, group, query_len, MAX_CONTEXT, head_size, DEVICE, itemsize)  # as batch 1's
    if batch_size > 1:  # the heuristic would not split here: force it, with programs taking several parts
        cfg = replace(cfg, split_programs=4)
    assert cfg.num_splits == 16, cfg
    return batch, cfg


def run(batch: PagedBatch, cfg, seq_lens: torch.Tensor, counters: torch.Tensor | None, out: torch.Tensor) -> None:
    from kernels import triton_attn

    meta = AttentionBatch(
        batch.block_table, batch.query_start_loc, seq_lens, True, batch.q.shape[-1] ** -0.5, batch.max_query_len,
        MAX_CONTEXT, split_counters=counters,
    )  # fmt: skip
    triton_attn.forward(batch.q, batch.k_cache, batch.v_cache, meta, out, cfg)


def unsplit(batch: PagedBatch, cfg, seq_lens: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(batch.q)
    run(batch, replace(cfg, num_splits=1, split_programs=None), seq_lens, None, out)
    return out


@pytest.mark.parametrize("query_len", [1, 8])
@pytest.mark.parametrize("batch_size", [1, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_repeated_calls_give_the_same_bits(shape: str, dtype: torch.dtype, batch_size: int, query_len: int) -> None:
    batch, cfg = setup(shape, dtype, batch_size, query_len)
    seq_lens = torch.tensor(lengths(batch_size, query_len, 0), dtype=torch.int32, device=DEVICE)
    counters = new_split_counters(batch_size, batch.q.shape[1], DEVICE)
    first = torch.full_like(batch.q, float("nan"))
    run(batch, cfg, seq_lens, counters, first)
    out = torch.empty_like(batch.q)
    mismatches = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for _ in range(200):
        out.fill_(float("nan"))
        run(batch, cfg, seq_lens, counters, out)
        mismatches += (out != first).sum()
    torch.cuda.synchronize()
    assert mismatches.item() == 0
    assert not counters.any()
    two = torch.empty_like(batch.q)
    run(batch, cfg, seq_lens, None, two)
    torch.testing.assert_close(first, two, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(first, unsplit(batch, cfg, seq_lens), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("query_len", [1, 8])
@pytest.mark.parametrize("batch_size", [1, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_replays_match_the_unsplit_kernel(dtype: torch.dtype, batch_size: int, query_len: int) -> None:
    batch, cfg = setup("smollm2", dtype, batch_size, query_len)
    seq_lens = torch.tensor(lengths(batch_size, query_len, 0), dtype=torch.int32, device=DEVICE)
    counters = new_split_counters(batch_size, batch.q.shape[1], DEVICE)
    out = torch.empty_like(batch.q)
    run(batch, cfg, seq_lens, counters, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(batch, cfg, seq_lens, counters, out)
    for replay in range(50):
        seq_lens.copy_(torch.tensor(lengths(batch_size, query_len, replay + 1), dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = unsplit(batch, cfg, seq_lens)
        torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype], msg=f"replay {replay}")
    torch.cuda.synchronize()
    assert not counters.any()

"""TRITON_ATTN paths the spec matrix may not reach on a small machine: split-KV and its combine,
tiles that span pages, rows padded when the GQA group does not divide the tile."""

from __future__ import annotations

import pytest
import torch

from kernels import unavailable_reason
from kernels.attention import AttentionBatch
from kernels.testing import BATCH_SPECS, BatchSpec, make_paged_batch, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = 2e-4 if DTYPE is torch.float32 else 1.6e-2

pytestmark = pytest.mark.skipif(unavailable_reason("TRITON_ATTN", DEVICE) is not None, reason="triton unavailable")


def _run(
    spec: BatchSpec, causal: bool, config, group: int = 4, block_size: int = 16, head_size: int = 64
) -> torch.Tensor:
    from kernels import triton_attn

    batch = make_paged_batch(spec, 2 * group, 2, head_size, block_size, DTYPE, DEVICE, seed=7)
    meta = AttentionBatch(
        block_table=batch.block_table,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        causal=causal,
        scale=head_size**-0.5,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    out = torch.full_like(batch.q, float("nan"))
    triton_attn.forward(batch.q, batch.k_cache, batch.v_cache, meta, out, config)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, causal), atol=TOL, rtol=TOL)
    return out


@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("spec", ["small_decode", "dflash_small", "mixed_small"])
def test_split_kv_matches_reference(spec: str, causal: bool, num_splits: int) -> None:
    """Splits shorter than some requests' keys, empty splits for short requests, the combine."""
    from kernels.triton_attn import LaunchConfig

    _run(
        BATCH_SPECS[spec],
        causal,
        LaunchConfig(block_m=64, block_n=16, num_splits=num_splits, num_warps=4, num_stages=2, min_split_len=16),
    )


@pytest.mark.parametrize("spec", ["small_decode", "dflash_small"])
def test_split_boundaries_do_not_depend_on_the_launch(spec: str) -> None:
    """A CUDA graph launches the splits of its largest context, eager those of the batch's: each request's
    keys must split at the same places, so both give bit-identical outputs (graph == eager drafting)."""
    from kernels.triton_attn import LaunchConfig

    longest = max(BATCH_SPECS[spec].seq_lens)
    needed = 1 << (-(-longest // 32) - 1).bit_length()  # what choose_config launches for min_split_len 32
    outputs = [
        _run(BATCH_SPECS[spec], False, LaunchConfig(64, 16, splits, 4, 2, min_split_len=32)) for splits in (needed, 16)
    ]
    assert needed < 16 and torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("split_programs", [1, 3])
@pytest.mark.parametrize("spec", ["small_decode", "dflash_small"])
def test_fewer_split_programs_give_the_same_output(spec: str, split_programs: int) -> None:
    """A launch of fewer programs than splits (a full GPU: split_count) has each program take every n-th split:
    the same splits, so bit-identical outputs to one program per split."""
    from kernels.triton_attn import LaunchConfig

    def config(programs: int | None) -> LaunchConfig:
        return LaunchConfig(64, 16, 8, 4, 2, min_split_len=16, split_programs=programs)

    assert torch.equal(
        _run(BATCH_SPECS[spec], True, config(None)), _run(BATCH_SPECS[spec], True, config(split_programs))
    )


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_tiles_across_and_within_pages(block_n: int, block_size: int) -> None:
    from kernels.triton_attn import LaunchConfig

    spec = BatchSpec("odd", (7, 70, 129), (7, 3, 9))
    _run(
        spec,
        True,
        LaunchConfig(block_m=32, block_n=block_n, num_splits=1, num_warps=4, num_stages=2),
        block_size=block_size,
    )


@pytest.mark.parametrize("group", [3, 5])
def test_group_that_does_not_divide_the_tile(group: int) -> None:
    """GQA groups of 3 or 5 leave padding rows in every tile."""
    spec = BatchSpec("odd_group", (40, 90), (12, 20))
    for causal in (True, False):
        _run(spec, causal, None, group=group)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_unpacked_heads_for_prefill(causal: bool, block_m: int) -> None:
    """Prefill tiles of one query head each (pack_gqa=False): several tiles per request and head."""
    from kernels.triton_attn import LaunchConfig

    spec = BatchSpec("prefill_like", (70, 45, 16), (70, 30, 5))
    config = LaunchConfig(block_m=block_m, block_n=16, num_splits=1, num_warps=4, num_stages=2, pack_gqa=False)
    _run(spec, causal, config)

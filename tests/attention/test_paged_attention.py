"""Every backend against the float64 reference: vLLM's batch specs plus DFlash blocks, causal and not,
GQA 1/4/8, block sizes 16 and 128, shuffled blocks, a NaN block, a NaN-filled output buffer.

On a CPU-only machine the small specs run (Triton kernels through the interpreter); the GPU host runs
every spec (`-m gpu` selects just those).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kernels import paged_attention, unavailable_reason
from kernels.attention import refusal_reasons
from kernels.testing import BATCH_SPECS, make_paged_batch, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
BACKENDS = ["CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN", "ROCM_ATTN", "FLASH_ATTN"]
CPU_SPECS = ["small_decode", "small_prefill", "mixed_small", "dflash_small"]
GPU_SPECS = [name for name in BATCH_SPECS if name not in CPU_SPECS]
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 1.6e-2}
gpu = pytest.mark.gpu


def _spec_params() -> list:
    params = [pytest.param(name, id=name) for name in CPU_SPECS]
    return params + [pytest.param(name, id=name, marks=[gpu]) for name in GPU_SPECS]


def _dtypes() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]


def spec_seed(spec: str) -> int:
    """A seed that is the same in every process (`hash` of a str is randomized per process), so a failure
    reproduces: the CRC-32 of the spec's repr."""
    return zlib.crc32(repr(BATCH_SPECS[spec]).encode()) % 1000


def run_case(
    backend: str, spec: str, causal: bool, group: int, block_size: int, dtype: torch.dtype, head_size: int = 128
) -> None:
    if backend == "FLASH_ATTN" and dtype == torch.float32:
        pytest.skip("FLASH_ATTN takes fp16/bf16 only (its capability entry)")
    reason = unavailable_reason(backend, DEVICE)
    if reason is not None:
        pytest.skip(f"{backend} unavailable here: {reason}")
    if not ON_GPU and spec in GPU_SPECS:
        pytest.skip("large spec: GPU only")
    num_kv_heads = 2 if ON_GPU else 1
    batch = make_paged_batch(
        BATCH_SPECS[spec],
        num_kv_heads * group,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        DEVICE,
        seed=spec_seed(spec),
    )
    refused = refusal_reasons(backend, batch.q, batch.k_cache, causal)
    if refused:  # not claimed by the capability entry (the agreement tests check the refusal itself)
        pytest.skip(f"{backend} does not claim this call: {refused}")
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention(
        backend,
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        causal,
        out=out,
    )
    assert result.data_ptr() == out.data_ptr()
    expected = reference_attention(batch, causal)
    assert not torch.isnan(out).any(), "NaN in the output: a key past a request's length leaked in"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", _spec_params())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("group", [1, 4, 8], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_attention_matches_reference(backend: str, spec: str, causal: bool, group: int, block_size: int) -> None:
    for dtype in _dtypes():
        run_case(backend, spec, causal, group, block_size, dtype)


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "ROCM_ATTN", "FLEX_ATTENTION", "CPU_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("head_size", [64, 80, 96, 256])
def test_head_sizes(backend: str, head_size: int) -> None:
    for dtype in _dtypes():
        run_case(backend, "mixed_small", True, 4, 16, dtype, head_size)
        run_case(backend, "dflash_small", False, 4, 16, dtype, head_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_query_rows_and_requests(backend: str) -> None:
    """A request with no new tokens (e.g. finished prefill chunk bookkeeping) leaves others intact."""
    reason = unavailable_reason(backend, DEVICE)
    if reason is not None:
        pytest.skip(reason)
    dtype = _dtypes()[0]
    from kernels.testing import BatchSpec

    spec = BatchSpec("with_empty", (20, 33, 17), (3, 0, 2))
    batch = make_paged_batch(spec, 4, 2, 64, 16, dtype, DEVICE, seed=3)
    out = paged_attention(
        backend, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, True
    )
    torch.testing.assert_close(
        out.double().cpu(), reference_attention(batch, True), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )

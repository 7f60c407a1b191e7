"""Each implementation does what its capability entry claims, and refuses what it does not claim.

The entry is the selector's promise; here every claim that can run on this machine is run against the
float64 reference (claimed dtypes, edge head and block sizes, non-causal), and every call outside the
entry is refused by `paged_attention` with the table's own reason.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, unavailable_reason
from kernels.attention import IMPLEMENTATIONS, TORCH_DTYPES, refusal_reasons
from kernels.capabilities import BACKENDS, DType, SizeRule
from kernels.testing import BatchSpec, make_paged_batch, reference_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC = BatchSpec("agreement", (33, 50), (5, 2))
TOL = {DType.FLOAT32: 2e-4, DType.FLOAT16: 1e-2, DType.BFLOAT16: 1.6e-2}
FROM_TABLE = {dtype: torch_dtype for torch_dtype, dtype in TORCH_DTYPES.items()}


def _runnable(backend: str) -> None:
    reason = unavailable_reason(backend, DEVICE)
    if reason is not None:
        pytest.skip(f"{backend} unavailable here: {reason}")


def _sample(rule: SizeRule, candidates: tuple[int, ...]) -> list[int]:
    """Sizes the rule accepts: its explicit list's ends, else the given candidates it accepts."""
    if rule.allowed:
        return sorted({rule.allowed[0], rule.allowed[-1]})
    return [n for n in candidates if rule.accepts(n)]


def _check(backend: str, dtype: torch.dtype, head_size: int, block_size: int, causal: bool) -> None:
    batch = make_paged_batch(SPEC, 4, 2, head_size, block_size, dtype, DEVICE, seed=head_size + block_size)
    if refusal_reasons(backend, batch.q, batch.k_cache, causal):
        return  # narrowed for the installed library / device (e.g. FA4's head sizes); refusals tested below
    out = paged_attention(
        backend, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, causal
    )
    tol = TOL[TORCH_DTYPES[dtype]]
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, causal), atol=tol, rtol=tol)


def test_every_implementation_has_a_table_entry() -> None:
    assert set(IMPLEMENTATIONS) <= set(BACKENDS)


@pytest.mark.parametrize("backend", list(IMPLEMENTATIONS))
def test_claimed_dtypes_and_causality_compute_correctly(backend: str) -> None:
    _runnable(backend)
    capability = BACKENDS[backend]
    for dtype in capability.dtypes:
        if DEVICE.type == "cpu" and dtype is DType.BFLOAT16 and backend in ("TRITON_ATTN", "ROCM_ATTN"):
            continue  # Triton's interpreter gets bf16 tl.dot wrong (numpy has no bf16); checked on the GPU
        for causal in (True, False) if capability.supports_non_causal else (True,):
            _check(backend, FROM_TABLE[dtype], 64, 16, causal)


@pytest.mark.parametrize("backend", list(IMPLEMENTATIONS))
def test_claimed_head_and_block_sizes_compute_correctly(backend: str) -> None:
    _runnable(backend)
    capability = BACKENDS[backend]
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    for head_size in _sample(capability.head_sizes, (32, 40, 64, 96, 128, 256)):
        _check(backend, dtype, head_size, 16, False)
    for block_size in _sample(capability.block_sizes, (16, 32, 48, 256)):
        _check(backend, dtype, 64, block_size, True)


def test_refusals_use_the_tables_reasons() -> None:
    batch = make_paged_batch(SPEC, 4, 2, 16, 16, torch.float32, DEVICE)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, True)
    with pytest.raises(ValueError, match=r"TRITON_ATTN cannot run this call: \['head_size not supported'\]"):
        paged_attention("TRITON_ATTN", *args)
    with pytest.raises(ValueError, match=r"FLASH_ATTN cannot run this call: \[.*'dtype not supported'"):
        paged_attention("FLASH_ATTN", *args)
    odd = make_paged_batch(SPEC, 4, 2, 64, 8, torch.float32, DEVICE)
    odd_args = (odd.q, odd.k_cache, odd.v_cache, odd.block_table, odd.query_start_loc, odd.seq_lens, False)
    with pytest.raises(ValueError, match=r"FLEX_ATTENTION cannot run this call: \['block_size not supported'\]"):
        paged_attention("FLEX_ATTENTION", *odd_args)


def test_non_causal_is_refused_where_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """R9: a step that needs non-causal attention on a backend that does not claim it fails clearly."""
    import dataclasses

    monkeypatch.setitem(BACKENDS, "CPU_ATTN", dataclasses.replace(BACKENDS["CPU_ATTN"], supports_non_causal=False))
    batch = make_paged_batch(SPEC, 4, 2, 64, 16, torch.float32, DEVICE)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    with pytest.raises(ValueError, match="non-causal attention not supported"):
        paged_attention("CPU_ATTN", *args, False)
    paged_attention("CPU_ATTN", *args, True)  # causal still serves


def test_unimplemented_backends_are_unavailable() -> None:
    for name in set(BACKENDS) - set(IMPLEMENTATIONS):
        assert "no implementation in this project" in unavailable_reason(name, DEVICE)

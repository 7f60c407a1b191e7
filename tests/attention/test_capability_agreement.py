"""Each implementation does what its capability entry claims, and refuses what it does not claim.

The entry is the selector's promise; here every claim that can run on this machine is run against the
float64 reference (claimed dtypes, edge head and block sizes, non-causal), and every call outside the
entry is refused by `paged_attention` with the table's own reason.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, unavailable_reason
from kernels.attention import IMPLEMENTATIONS, TORCH_DTYPES, implementation, refusal_reasons
from kernels.capabilities import (
    BACKENDS,
    COMPUTE_CAPABILITY_NOT_SUPPORTED,
    AttentionNeeds,
    DType,
    Hardware,
    Platform,
    SizeRule,
)
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


Case = tuple[torch.dtype, int, int, bool]  # dtype, head size, block size, causal


def _narrowed(backend: str, case: Case) -> bool:
    """Whether the installed library's version check (FA4's head sizes, ...) takes this claimed case back.

    Asked of the entry's `version_check` directly, not through `refusal_reasons`, so a refusal that the
    table does not make shows up as a case missing from the computed ones."""
    capability = BACKENDS[backend]
    version = getattr(implementation(backend), "library_version", lambda: None)()
    if capability.version_check is None or version is None:
        return False
    dtype, head_size, block_size, causal = case
    needs = AttentionNeeds(head_size, TORCH_DTYPES[dtype], block_size=block_size, use_non_causal=not causal)
    on_cuda = DEVICE.type == "cuda"
    hardware = Hardware(
        platform=(Platform.ROCM if torch.version.hip else Platform.CUDA) if on_cuda else Platform.CPU,
        compute_capability=torch.cuda.get_device_capability(DEVICE) if on_cuda else (0, 0),
        libraries=((capability.required_library, version),),
    )
    # The device itself is unavailable_reason's business (the test is skipped then).
    return any(r != COMPUTE_CAPABILITY_NOT_SUPPORTED for r in capability.version_check(needs, hardware, version))


def _check(backend: str, case: Case) -> bool:
    """Runs one claimed case against the reference; False (nothing run) when the table refuses it."""
    dtype, head_size, block_size, causal = case
    batch = make_paged_batch(SPEC, 4, 2, head_size, block_size, dtype, DEVICE, seed=head_size + block_size)
    if refusal_reasons(backend, batch.q, batch.k_cache, causal):
        return False  # narrowed for the installed library / device; the callers check it was expected
    out = paged_attention(
        backend, batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, causal
    )
    tol = TOL[TORCH_DTYPES[dtype]]
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, causal), atol=tol, rtol=tol)
    return True


def _check_all(backend: str, cases: list[Case]) -> None:
    """Every claimed case computes, except exactly those the installed library's version narrows away."""
    computed = [case for case in cases if _check(backend, case)]
    expected = [case for case in cases if not _narrowed(backend, case)]
    refused = [case for case in expected if case not in computed]
    unclaimed = [case for case in computed if case not in expected]
    assert computed == expected, f"{backend}: claimed but refused {refused}; computed though narrowed {unclaimed}"
    assert computed, f"{backend}: no claimed case was computed"


def test_every_implementation_has_a_table_entry() -> None:
    assert set(IMPLEMENTATIONS) <= set(BACKENDS)


@pytest.mark.parametrize("backend", list(IMPLEMENTATIONS))
def test_claimed_dtypes_and_causality_compute_correctly(backend: str) -> None:
    _runnable(backend)
    capability = BACKENDS[backend]
    cases: list[Case] = []
    for dtype in capability.dtypes:
        if DEVICE.type == "cpu" and dtype is DType.BFLOAT16 and backend in ("TRITON_ATTN", "ROCM_ATTN"):
            continue  # Triton's interpreter gets bf16 tl.dot wrong (numpy has no bf16); checked on the GPU
        for causal in (True, False) if capability.supports_non_causal else (True,):
            cases.append((FROM_TABLE[dtype], 64, 16, causal))
    _check_all(backend, cases)


@pytest.mark.parametrize("backend", list(IMPLEMENTATIONS))
def test_claimed_head_and_block_sizes_compute_correctly(backend: str) -> None:
    _runnable(backend)
    capability = BACKENDS[backend]
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    causal = not capability.supports_non_causal  # non-causal where claimed, the harder mask
    cases: list[Case] = [(dtype, h, 16, causal) for h in _sample(capability.head_sizes, (32, 40, 64, 96, 128, 256))]
    cases += [(dtype, 64, b, True) for b in _sample(capability.block_sizes, (16, 32, 48, 256))]
    _check_all(backend, cases)


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

"""vLLM's tests/kernels/attention/test_attention_selector.py, ported to our rules (R1 to R8 of
docs/selection.md's R1-R11).

vLLM patches its platform object; we describe the platform in the capability report instead, which
also lets every platform's case run on this CPU-only machine.
"""

from __future__ import annotations

import pytest
from builders import cpu, cuda, layers, request, rocm

from selection.registry import UnknownBackendError, normalize_backend_name
from selection.selector import select_backends
from specdec.v1 import common_pb2
from specdec_runtime.errors import FailedPrecondition, InvalidArgument, SpecdecError

FP16 = common_pb2.DTYPE_FLOAT16
FP32 = common_pb2.DTYPE_FLOAT32

# test_backend_selection: a forced regular (non-MLA) backend per platform is returned as is.
FORCED = [
    # (platform report, backend, head_size): vLLM forces FLASHINFER with head 64, FLASH_ATTN with 32.
    (cuda(9, 0, flashinfer="0.5.0"), "FLASHINFER", 64),
    (cuda(9, 0, flash_attn="4.0.0b36"), "FLASH_ATTN", 32),
    (cuda(8, 0, flash_attn="2.8.3"), "FLASH_ATTN", 32),  # FA2: pages of 256
    (rocm(), "ROCM_ATTN", 32),
    (cpu(), "CPU_ATTN", 16),
]


@pytest.mark.parametrize(("hardware", "name", "head_size"), FORCED, ids=[f"{h.platform}-{n}" for h, n, _ in FORCED])
def test_backend_selection(hardware: common_pb2.HardwareCapabilities, name: str, head_size: int) -> None:
    block_size = 256 if name == "FLASH_ATTN" and hardware.compute_capability_major == 8 else 16
    req = request(hardware, layers(head_size, FP16, block_size=block_size), backend=name)
    decision = select_backends(req).target
    assert decision.backend == name
    assert decision.explicit
    assert [(c.backend, list(c.reasons)) for c in decision.candidates] == [(name, [])]


@pytest.mark.parametrize(
    ("hardware", "expected"),
    [(cpu(), "CPU_ATTN"), (cuda(9, 0, flash_attn="4.0.0b36", flashinfer="0.5.0"), "FLEX_ATTENTION")],
    ids=["cpu", "cuda"],
)
def test_fp32_fallback(hardware: common_pb2.HardwareCapabilities, expected: str) -> None:
    """Head 16 in fp32: only the backends that take both remain."""
    assert select_backends(request(hardware, layers(16, FP32, num_heads=4, num_kv_heads=4))).target.backend == expected


def test_fp32_fallback_rocm_has_no_backend() -> None:
    with pytest.raises(FailedPrecondition, match="No valid attention backend") as err:
        select_backends(request(rocm(aiter="0.1.5"), layers(16, FP32, num_heads=4, num_kv_heads=4)))
    assert "ROCM_ATTN: [head_size not supported]" in err.value.message
    assert [v.subject for v in err.value.precondition_violations] == [
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
        "TRITON_ATTN",
    ]


def test_invalid_backend() -> None:
    with pytest.raises(UnknownBackendError, match=r"Unknown attention backend: 'INVALID'\. Valid options are: auto, "):
        normalize_backend_name("INVALID")
    with pytest.raises(InvalidArgument) as err:
        select_backends(request(backend="INVALID"))
    assert err.value.field_violations[0].field == "attention.backend"
    assert "FLASH_ATTN" in err.value.field_violations[0].description


@pytest.mark.parametrize("auto_value", ["auto", "AUTO", "Auto", "", "  auto "])
def test_auto_backend_string(auto_value: str) -> None:
    assert normalize_backend_name(auto_value) is None


@pytest.mark.parametrize("auto_value", ["auto", "AUTO", "Auto"])
def test_auto_backend_selection_behavior(auto_value: str) -> None:
    """'auto' selects exactly what an empty backend selects, on every platform."""
    for hardware in (cpu(), cuda(9, 0, flash_attn="4.0.0b36"), cuda(10, 0, flashinfer="0.5.0"), rocm()):
        auto = select_backends(request(hardware, backend=auto_value))
        default = select_backends(request(hardware))
        assert auto == default
        assert not auto.target.explicit


@pytest.mark.parametrize("name", ["flash_attn", "Flash_Attn", "FLASH_ATTN"])
def test_backend_names_are_case_insensitive(name: str) -> None:
    assert select_backends(request(backend=name)).target.backend == "FLASH_ATTN"


@pytest.mark.parametrize(
    ("name", "use_non_causal"),
    [("FLASH_ATTN", True), ("FLASH_ATTN", False), ("FLASHINFER", True), ("FLASHINFER", False)],
)
def test_non_causal_backend_selection(name: str, use_non_causal: bool) -> None:
    """use_non_causal steers validation; backends that support it succeed either way."""
    hardware = cuda(9, 0, flash_attn="4.0.0b36", flashinfer="0.5.0")
    decision = select_backends(
        request(hardware, layers(128, FP16, block_size=16), backend=name, use_non_causal=use_non_causal)
    ).target
    assert decision.backend == name
    assert decision.use_non_causal == use_non_causal


def test_non_causal_backend_selection_rejects_causal_only_backend() -> None:
    with pytest.raises(InvalidArgument, match="non-causal"):
        select_backends(
            request(rocm(aiter="0.1.5"), layers(128, FP16), backend="ROCM_AITER_UNIFIED_ATTN", use_non_causal=True)
        )


@pytest.mark.parametrize(
    "hardware",
    [
        cuda(9, 0, flash_attn="4.0.0b36"),
        cuda(10, 0, flash_attn="4.0.0b36", flashinfer="0.5.0"),
        cuda(8, 6),
        rocm(aiter="0.1.5"),
        cpu(),
    ],
    ids=["sm90", "sm100", "sm86-no-fa", "rocm", "cpu"],
)
def test_non_causal_autoselect_backend(hardware: common_pb2.HardwareCapabilities) -> None:
    """Autoselection with use_non_causal picks a backend whose capability entry supports it."""
    from kernels.capabilities import BACKENDS

    decision = select_backends(request(hardware, layers(128, FP16, block_size=16), use_non_causal=True)).target
    assert BACKENDS[decision.backend].supports_non_causal
    assert decision.use_non_causal


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_flash_attn_rejects_unhandled_kv_cache_dtypes(kv_cache_dtype: str) -> None:
    """vLLM's FA takes fp8/fp8_e4m3 with descales; our wrapper passes none, so it claims no fp8 KV."""
    with pytest.raises(InvalidArgument, match=r"Reason: \['kv_cache_dtype not supported'\]"):
        select_backends(request(target=layers(kv_cache_dtype=kv_cache_dtype), backend="FLASH_ATTN"))


def test_fp8_kv_cache_autoselects_a_backend_that_claims_it() -> None:
    hardware = cuda(9, 0, flash_attn="4.0.0b36", flashinfer="0.5.0")
    assert select_backends(request(hardware, layers(kv_cache_dtype="fp8"))).target.backend == "FLASHINFER"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "nvfp4", "int8_per_token_head"])
def test_unknown_kv_cache_dtypes_are_bad_input(kv_cache_dtype: str) -> None:
    """Cache dtypes no backend of ours knows are refused as bad input, not as unsupported."""
    with pytest.raises(InvalidArgument) as err:
        select_backends(request(target=layers(kv_cache_dtype=kv_cache_dtype), backend="FLASH_ATTN"))
    assert err.value.field_violations[0].field == "target_layers.kv_cache_dtype"


def test_fa2_needs_pages_of_256_tokens() -> None:
    hardware = cuda(8, 0, flash_attn="2.8.3")
    assert (
        select_backends(request(hardware, layers(block_size=256), backend="FLASH_ATTN")).target.backend == "FLASH_ATTN"
    )
    with pytest.raises(SpecdecError, match=r"Reason: \['block_size not supported'\]"):
        select_backends(request(hardware, layers(block_size=16), backend="FLASH_ATTN"))

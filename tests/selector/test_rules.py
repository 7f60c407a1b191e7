"""The selection rules R1 to R8 of docs/selection.md's R1-R11, one group of tests per rule (R9: tests/attention/
test_capability_agreement.py and tests/executor/server/test_spec_formats.py; R10:
tests/executor/spec_decode/test_spec_metadata.py; R11: tests/selector/test_tree_selection.py)."""

from __future__ import annotations

import subprocess
import sys
import traceback

import pytest
from builders import cpu, cuda, dflash, eagle, layers, request, rocm

from kernels import capabilities as caps
from kernels.capabilities import BACKENDS, AttentionNeeds, DType, Hardware, Platform
from selection.rules import PRIORITIES
from selection.selector import Selector, select_backends
from specdec.v1 import common_pb2
from specdec_runtime.errors import FailedPrecondition, InvalidArgument

H100_FA4 = cuda(9, 0, flash_attn="4.0.0b36")
BF16 = common_pb2.DTYPE_BFLOAT16


def candidates(decision: common_pb2.BackendDecision) -> list[tuple[str, list[str]]]:
    return [(c.backend, list(c.reasons)) for c in decision.candidates]


# R1: declared capabilities and one fixed reason vocabulary ------------------------------------------


def test_table_covers_every_backend_of_the_priority_lists() -> None:
    named = {name for priority in PRIORITIES for name in priority.backends}
    assert named == set(BACKENDS)
    assert set(BACKENDS) == {
        "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION",
        "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "CPU_ATTN",
    }  # fmt: skip


CUDA_ALL = Hardware(
    Platform.CUDA,
    (9, 0),
    libraries=(("flash_attn", "4.0.0b36"), ("flashinfer", "0.5"), ("torch", "2"), ("triton", "3")),
)
BASE = AttentionNeeds(head_size=128, dtype=DType.BFLOAT16)


@pytest.mark.parametrize(
    ("backend", "needs", "hardware", "reason"),
    [
        ("CPU_ATTN", BASE, CUDA_ALL, caps.PLATFORM_NOT_SUPPORTED),
        ("FLASHINFER", AttentionNeeds(head_size=96, dtype=DType.BFLOAT16), CUDA_ALL, caps.HEAD_SIZE_NOT_SUPPORTED),
        ("FLASH_ATTN", AttentionNeeds(head_size=128, dtype=DType.FLOAT32), CUDA_ALL, caps.DTYPE_NOT_SUPPORTED),
        (
            "FLEX_ATTENTION",
            AttentionNeeds(128, DType.BFLOAT16, kv_cache_dtype="fp8"),
            CUDA_ALL,
            caps.KV_CACHE_DTYPE_NOT_SUPPORTED,
        ),
        ("FLASHINFER", AttentionNeeds(128, DType.BFLOAT16, block_size=128), CUDA_ALL, caps.BLOCK_SIZE_NOT_SUPPORTED),
        ("TRITON_ATTN", AttentionNeeds(128, DType.BFLOAT16, use_mla=True), CUDA_ALL, caps.MLA_NOT_SUPPORTED),
        ("FLEX_ATTENTION", AttentionNeeds(128, DType.BFLOAT16, has_sink=True), CUDA_ALL, caps.SINK_NOT_SUPPORTED),
        (
            "FLASH_ATTN",
            BASE,
            Hardware(Platform.CUDA, (7, 5), libraries=(("flash_attn", "2.8.3"),)),
            caps.COMPUTE_CAPABILITY_NOT_SUPPORTED,
        ),
        (
            "ROCM_AITER_FA",
            BASE,
            Hardware(Platform.ROCM, gcn_arch="gfx90a", libraries=(("aiter", "0.1"),)),
            caps.COMPUTE_CAPABILITY_NOT_SUPPORTED,
        ),
        (
            "ROCM_AITER_UNIFIED_ATTN",
            AttentionNeeds(128, DType.BFLOAT16, use_non_causal=True),
            Hardware(Platform.ROCM, gcn_arch="gfx942", libraries=(("aiter", "0.1"),)),
            caps.NON_CAUSAL_NOT_SUPPORTED,
        ),
        ("FLASHINFER", BASE, Hardware(Platform.CUDA, (9, 0)), "flashinfer not installed"),
    ],
)
def test_every_reason_of_the_vocabulary_is_reachable(
    backend: str, needs: AttentionNeeds, hardware: Hardware, reason: str
) -> None:
    assert BACKENDS[backend].validate(needs, hardware) == [reason]
    assert reason in caps.reason_vocabulary()


def test_sliding_window_reason_for_a_backend_without_windows() -> None:
    windowless = caps.BackendCapability(
        name="X", description="", platforms=(Platform.CPU,), dtypes=(DType.BFLOAT16,), kv_cache_dtypes=("auto",),
        head_sizes=caps.SizeRule(), block_sizes=caps.SizeRule(), required_library="torch",
        supports_sliding_window=False,
    )  # fmt: skip
    needs = AttentionNeeds(128, DType.BFLOAT16, has_sliding_window=True)
    assert windowless.validate(needs, Hardware(Platform.CPU, libraries=(("torch", "2"),))) == [
        caps.SLIDING_WINDOW_NOT_SUPPORTED
    ]


def test_reasons_come_in_vocabulary_order_and_library_last() -> None:
    needs = AttentionNeeds(
        head_size=100, dtype=DType.FLOAT32, kv_cache_dtype="fp8_e5m2", block_size=8, use_non_causal=True
    )
    reasons = BACKENDS["FLASHINFER"].validate(needs, Hardware(Platform.ROCM, gcn_arch="gfx942"))
    assert reasons == [
        caps.PLATFORM_NOT_SUPPORTED,
        caps.HEAD_SIZE_NOT_SUPPORTED,
        caps.DTYPE_NOT_SUPPORTED,
        caps.BLOCK_SIZE_NOT_SUPPORTED,
        "flashinfer not installed",
    ]


@pytest.mark.parametrize(
    ("version", "major", "head_size", "block_size", "valid"),
    [
        ("2.8.3", 8, 128, 256, True),
        ("2.8.3", 9, 256, 512, True),  # FA2 runs on Hopper too
        ("2.8.3", 8, 128, None, True),  # the backend's choice of page size
        ("2.8.3", 8, 128, 16, False),  # FA2 pages are multiples of 256 tokens
        ("2.8.3", 8, 512, 256, False),  # FA2 stops at head 256
        ("3.0.0", 8, 128, 16, False),  # FA3 is Hopper only
        ("3.0.0", 9, 128, 16, True),
        ("4.0.0b36", 8, 128, 16, False),  # FA4 is SM9x/SM10x
        ("4.0.0b36", 9, 256, 16, True),
        ("4.0.0b36", 9, 32, 16, True),
        ("4.0.0b36", 9, 96, 16, False),  # FA4 b36 paged: wrong results for 80/96 on an H100
        ("4.0.0b36", 9, 40, 128, False),  # "Paged KV does not support irregular head dim"
        ("4.0.0b36", 9, 512, 128, False),  # SM90: heads up to 256
        ("4.0.0b36", 10, 512, 128, True),
        ("4.0.0b36", 10, 192, 128, False),  # SM100: 32, 64, 128, 256 or 512
        ("4.0.0b36", 12, 128, 16, False),
    ],
)
def test_flash_attn_version_narrows_the_table(
    version: str, major: int, head_size: int, block_size: int | None, valid: bool
) -> None:
    needs = AttentionNeeds(head_size, DType.BFLOAT16, block_size=block_size)
    hardware = Hardware(Platform.CUDA, (major, 0), libraries=(("flash_attn", version),))
    reasons = BACKENDS["FLASH_ATTN"].validate(needs, hardware)
    assert (reasons == []) == valid, reasons


def test_capability_table_is_torch_free() -> None:
    """The selector's whole import graph stays off torch (it runs in a slim image)."""
    code = (
        "import sys, kernels, kernels.capabilities, selector_service.main, specdec_cli.cli;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# R2: an explicit backend is validated and used, or refused; never a silent fallback ------------------


def test_explicit_backend_is_used_even_when_auto_would_pick_another() -> None:
    decision = select_backends(request(H100_FA4, backend="FLEX_ATTENTION")).target
    assert (decision.backend, decision.explicit) == ("FLEX_ATTENTION", True)


def test_explicit_invalid_backend_fails_with_its_reasons() -> None:
    with pytest.raises(InvalidArgument) as err:
        select_backends(request(H100_FA4, layers(head_size=96), backend="FLASHINFER"))
    assert err.value.message == (
        "Selected backend FLASHINFER is not valid for this configuration. "
        "Reason: ['head_size not supported', 'flashinfer not installed']"
    )
    assert err.value.field_violations[0].field == "attention.backend"


# R3 + R4: auto walks the platform's priority list; every candidate is reported --------------------


@pytest.mark.parametrize(
    ("hardware", "use_non_causal", "order"),
    [
        (cuda(9, 0), False, ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (cuda(8, 0), True, ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (cuda(12, 0), False, ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (cuda(10, 0), False, ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (cuda(10, 3), True, ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]),
        (rocm(), False, ["ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN"]),
        (cpu(), True, ["CPU_ATTN"]),
    ],
    ids=["sm90", "sm80-nc", "sm120", "sm100-causal", "sm103-noncausal", "rocm", "cpu"],
)
def test_priority_lists(hardware: common_pb2.HardwareCapabilities, use_non_causal: bool, order: list[str]) -> None:
    decision = select_backends(request(hardware, use_non_causal=use_non_causal)).target
    assert [c.backend for c in decision.candidates] == order
    first_valid = next(c.backend for c in decision.candidates if not c.reasons)
    assert decision.backend == first_valid
    assert not decision.explicit


def test_auto_reports_every_candidate_with_reasons() -> None:
    decision = select_backends(request(cuda(9, 0))).target  # no flash_attn, no flashinfer
    assert candidates(decision) == [
        ("FLASH_ATTN", ["flash_attn not installed"]),
        ("FLASHINFER", ["flashinfer not installed"]),
        ("TRITON_ATTN", []),
        ("FLEX_ATTENTION", []),
    ]
    assert decision.backend == "TRITON_ATTN"


def test_sm100_prefers_flashinfer_when_causal() -> None:
    hardware = cuda(10, 0, flash_attn="4.0.0b36", flashinfer="0.5.0")
    assert select_backends(request(hardware)).target.backend == "FLASHINFER"
    assert select_backends(request(hardware, use_non_causal=True)).target.backend == "FLASH_ATTN"


def test_no_valid_backend_is_failed_precondition_with_every_reason() -> None:
    with pytest.raises(FailedPrecondition) as err:
        select_backends(request(cuda(9, 0), layers(head_size=16, dtype=common_pb2.DTYPE_FLOAT16, use_mla=True)))
    message = err.value.message
    assert message.startswith("No valid attention backend found for cuda (compute capability 9.0) with ")
    assert "role=target" in message and "head_size=16" in message
    assert "Reasons: {FLASH_ATTN: [MLA not supported, flash_attn not installed], " in message
    assert len(err.value.precondition_violations) == 4


# R5: the drafter is selected on its own, never inherited --------------------------------------------


def test_drafter_does_not_inherit_the_targets_explicit_backend() -> None:
    response = select_backends(request(H100_FA4, backend="FLEX_ATTENTION", speculative=eagle()))
    assert response.target.backend == "FLEX_ATTENTION"
    assert response.drafter.backend == "FLASH_ATTN"
    assert not response.drafter.explicit


def test_drafter_explicit_backend_is_its_own() -> None:
    response = select_backends(request(H100_FA4, speculative=eagle(backend="triton_attn")))
    assert (response.target.backend, response.drafter.backend) == ("FLASH_ATTN", "TRITON_ATTN")
    assert response.drafter.explicit and not response.target.explicit


def test_drafter_is_validated_against_its_own_layers() -> None:
    """Target head 96 (FlashInfer cannot), drafter head 64 (FlashInfer can): reasons differ per stack."""
    spec = eagle(draft_layers=layers(head_size=64, num_heads=8, num_kv_heads=2))
    response = select_backends(request(H100_FA4, layers(head_size=96), speculative=spec))
    target_fi = next(c for c in response.target.candidates if c.backend == "FLASHINFER")
    drafter_fi = next(c for c in response.drafter.candidates if c.backend == "FLASHINFER")
    assert list(target_fi.reasons) == ["head_size not supported", "flashinfer not installed"]
    assert list(drafter_fi.reasons) == ["flashinfer not installed"]


def test_drafter_failure_names_the_drafter() -> None:
    spec = eagle(backend="FLASH_ATTN", draft_layers=layers(head_size=100, num_heads=8, num_kv_heads=2))
    with pytest.raises(InvalidArgument) as err:
        select_backends(request(H100_FA4, speculative=spec))
    assert err.value.field_violations[0].field == "speculative.attention_backend"
    assert "head_size not supported" in err.value.message


def test_no_drafter_without_speculation() -> None:
    assert not select_backends(request()).HasField("drafter")
    none = common_pb2.SpeculativeConfig(method=common_pb2.SPEC_METHOD_NONE)
    assert not select_backends(request(speculative=none)).HasField("drafter")


# R6: DFlash is non-causal unless dflash_config.causal; EAGLE drafters and targets are causal ---------


def test_dflash_drafter_is_non_causal_and_target_stays_causal() -> None:
    response = select_backends(request(H100_FA4, speculative=dflash()))
    assert response.drafter.use_non_causal and not response.target.use_non_causal


def test_causal_dflash_may_use_a_causal_only_backend() -> None:
    hardware = rocm(aiter="0.1.5")
    target = layers(head_size=128, block_size=16)
    spec = dflash(backend="ROCM_AITER_UNIFIED_ATTN", causal=True)
    causal = select_backends(request(hardware, target, speculative=spec)).drafter
    assert (causal.backend, causal.use_non_causal) == ("ROCM_AITER_UNIFIED_ATTN", False)
    with pytest.raises(InvalidArgument, match=r"Reason: \['non-causal attention not supported'\]"):
        select_backends(request(hardware, target, speculative=dflash(backend="ROCM_AITER_UNIFIED_ATTN")))


def test_causal_dflash_uses_the_causal_priority_list() -> None:
    hardware = cuda(10, 0, flash_attn="4.0.0b36", flashinfer="0.5.0")
    assert select_backends(request(hardware, speculative=dflash(causal=True))).drafter.backend == "FLASHINFER"
    nc = select_backends(request(hardware, speculative=dflash(causal=False))).drafter
    assert (nc.backend, nc.use_non_causal) == ("FLASH_ATTN", True)


@pytest.mark.parametrize("method", [common_pb2.SPEC_METHOD_EAGLE, common_pb2.SPEC_METHOD_EAGLE3])
def test_eagle_drafters_are_causal(method: int) -> None:
    response = select_backends(request(rocm(aiter="0.1.5"), layers(block_size=16), speculative=eagle(method)))
    assert response.drafter.backend == "ROCM_ATTN" and not response.drafter.use_non_causal


def test_non_causal_dflash_with_no_non_causal_backend_fails_for_the_drafter_only() -> None:
    """aiter's unified kernel is causal only: forced there, the target works and the drafter cannot."""
    hardware = rocm(aiter="0.1.5")
    target_only = select_backends(request(hardware, layers(block_size=16), backend="ROCM_AITER_UNIFIED_ATTN"))
    assert target_only.target.backend == "ROCM_AITER_UNIFIED_ATTN"
    spec = dflash(backend="ROCM_AITER_UNIFIED_ATTN")
    with pytest.raises(InvalidArgument) as err:
        select_backends(request(hardware, layers(block_size=16), backend="ROCM_AITER_UNIFIED_ATTN", speculative=spec))
    assert err.value.field_violations[0].field == "speculative.attention_backend"


# R7: non-causal support as declared ------------------------------------------------------------------


def test_non_causal_support_table() -> None:
    supported = {name for name, cap in BACKENDS.items() if cap.supports_non_causal}
    assert supported == set(BACKENDS) - {"ROCM_AITER_UNIFIED_ATTN"}


# R8: a backend whose library is absent is invalid -----------------------------------------------------


def test_missing_library_invalidates() -> None:
    no_triton = common_pb2.HardwareCapabilities(
        platform=common_pb2.PLATFORM_CUDA,
        compute_capability_major=9,
        libraries=[common_pb2.KernelLibrary(name="torch")],
    )
    decision = select_backends(request(no_triton)).target
    assert candidates(decision)[2] == ("TRITON_ATTN", ["triton not installed"])
    assert decision.backend == "FLEX_ATTENTION"
    with pytest.raises(FailedPrecondition, match="torch not installed"):
        select_backends(request(common_pb2.HardwareCapabilities(platform=common_pb2.PLATFORM_CPU)))


# The cache changes nothing but speed ------------------------------------------------------------------


def test_cached_selection_equals_uncached_and_is_a_private_copy() -> None:
    selector = Selector(cache_size=8)
    req = request(H100_FA4, speculative=dflash())
    first = selector.select(req)
    first.target.backend = "MUTATED"
    second = selector.select(req)
    assert second == select_backends(req)
    assert selector.cache_info().hits == 1


def test_cached_errors_are_raised_every_time_without_growing() -> None:
    """Each raise is a fresh error: one shared instance would accumulate traceback frames forever."""
    selector = Selector(cache_size=8)
    raised = []
    for _ in range(4):
        with pytest.raises(FailedPrecondition) as err:
            selector.select(request(cuda(9, 0), layers(head_size=16, use_mla=True)))
        raised.append(err.value)
    assert selector.cache_info().hits == 3
    assert len({id(e) for e in raised}) == 4
    depths = [len(traceback.extract_tb(e.__traceback__)) for e in raised]
    assert len(set(depths)) == 1, depths
    assert len({e.message for e in raised}) == 1


def test_selector_extra_installs_no_torch() -> None:
    """`pip install specdec[selector]` (the slim image) must not pull torch or triton."""
    from importlib.metadata import requires

    selector_reqs = [r for r in requires("specdec") or [] if 'extra == "selector"' in r]
    assert selector_reqs, "the selector extra is missing"
    assert not [r for r in selector_reqs if r.split()[0].lower().startswith(("torch", "triton"))]

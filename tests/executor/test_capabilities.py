"""The executor's capability report: what this machine really runs, fed to the selector."""

from __future__ import annotations

import pytest
import torch

from executor_service.capabilities import probe, runnable_libraries
from selector_service.selection import select_backends
from specdec.v1 import common_pb2, selector_pb2


def _names(report: common_pb2.HardwareCapabilities) -> set[str]:
    return {lib.name for lib in report.libraries}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report")
def test_cpu_report(monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton decides interpreted-or-compiled when a kernel module is imported: import them under the
    # interpreter first, so later tests in this process still run them interpreted.
    import kernels.rocm_attn
    import kernels.triton_attn  # noqa: F401

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = probe("cpu")
    assert report.platform == common_pb2.PLATFORM_CPU
    assert report.total_memory_bytes > 0 and report.device_count == 1 and report.device_name
    assert _names(report) == {"torch"}  # triton runs on a CPU only through its interpreter
    assert next(lib.version for lib in report.libraries if lib.name == "torch") == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter would stay on for GPU kernels")
def test_interpreter_makes_triton_runnable_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    libraries = runnable_libraries(torch.device("cpu"))
    assert set(libraries) == {"torch", "triton"}
    assert libraries["triton"] != "unknown"


def test_libraries_without_a_backend_of_ours_are_never_reported() -> None:
    assert not {"flashinfer", "aiter"} & _names(probe())


def test_report_drives_the_selector() -> None:
    """A CPU report selects CPU_ATTN for target and drafter; a GPU report selects a backend it can run."""
    request = selector_pb2.SelectBackendsRequest(
        hardware=probe(),
        target_layers=common_pb2.LayerSpec(head_size=64, num_heads=8, num_kv_heads=2, dtype=common_pb2.DTYPE_FLOAT32),
        speculative=common_pb2.SpeculativeConfig(
            method=common_pb2.SPEC_METHOD_DFLASH, dflash_config=common_pb2.DFlashConfig(mask_token_id=3)
        ),
    )
    response = select_backends(request)
    if not torch.cuda.is_available():
        assert (response.target.backend, response.drafter.backend) == ("CPU_ATTN", "CPU_ATTN")
        assert response.drafter.use_non_causal


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_report() -> None:
    report = probe()
    assert report.platform in (common_pb2.PLATFORM_CUDA, common_pb2.PLATFORM_ROCM)
    assert report.total_memory_bytes > 0 and report.device_count >= 1
    assert {"torch", "triton"} <= _names(report)
    if report.platform == common_pb2.PLATFORM_CUDA:
        assert report.compute_capability_major >= 7

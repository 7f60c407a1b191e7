"""The executor's capability report: what this machine really runs, fed to the selector."""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest
import torch

from executor_service.server.capabilities import probe, runnable_libraries
from kernels import unavailable_reason
from kernels.attention import IMPLEMENTATIONS
from selection.selector import select_backends
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
    assert response.drafter.use_non_causal  # DFlash drafts a block at once
    if not torch.cuda.is_available():
        assert (response.target.backend, response.drafter.backend) == ("CPU_ATTN", "CPU_ATTN")
    else:  # a GPU backend of ours that runs here, never the CPU fallback
        device = torch.device("cuda", 0)
        for chosen in (response.target.backend, response.drafter.backend):
            assert chosen in IMPLEMENTATIONS and chosen != "CPU_ATTN", chosen
            assert unavailable_reason(chosen, device) is None, chosen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_report() -> None:
    """Each probed fact equals what torch and the installed packages say about GPU 0."""
    report = probe()
    props = torch.cuda.get_device_properties(0)
    assert report.device_name == torch.cuda.get_device_name(0) and report.device_name
    assert report.total_memory_bytes == props.total_memory > 0
    assert report.device_count == torch.cuda.device_count() >= 1
    if torch.version.hip:
        assert report.platform == common_pb2.PLATFORM_ROCM
        assert report.gcn_arch == props.gcnArchName.split(":")[0] and report.gcn_arch.startswith("gfx")
        assert (report.compute_capability_major, report.compute_capability_minor) == (0, 0)
    else:
        assert report.platform == common_pb2.PLATFORM_CUDA
        capability = (report.compute_capability_major, report.compute_capability_minor)
        assert capability == torch.cuda.get_device_capability(0) and capability >= (7, 0)
        assert report.gcn_arch == ""
    versions = {lib.name: lib.version for lib in report.libraries}
    assert len(versions) == len(report.libraries), "a library reported twice"
    assert versions["torch"] == torch.__version__
    if importlib.util.find_spec("triton") is not None:  # TRITON_ATTN and ROCM_ATTN run on any GPU
        assert versions["triton"] == metadata.version("triton")
    else:
        assert "triton" not in versions
    assert set(versions) <= {"torch", "triton", "flash_attn"}  # the libraries our backends use
    if "flash_attn" in versions:
        assert importlib.util.find_spec("flash_attn") is not None and versions["flash_attn"] != "unknown"

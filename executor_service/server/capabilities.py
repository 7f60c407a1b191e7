"""What this machine can really run, as the HardwareCapabilities the selector decides from.

A kernel library is reported only when one of our attention backends that needs it can run here (R8):
reporting an importable library we have no wrapper for (flashinfer, aiter) would let the selector pick
a backend this executor cannot load.
"""

from __future__ import annotations

from importlib import metadata

import torch

from executor_service.parallel.state import tensor_parallel_size
from kernels import unavailable_reason
from kernels.attention import IMPLEMENTATIONS
from kernels.capabilities import BACKENDS
from specdec.v1 import common_pb2


def probe(device: torch.device | str | None = None) -> common_pb2.HardwareCapabilities:
    """The capability report of `device` (default: the first GPU if there is one, else the CPU)."""
    device = torch.device(device) if device is not None else default_device()
    report = common_pb2.HardwareCapabilities(device_count=1)
    if device.type == "cuda":
        index = device.index or 0
        props = torch.cuda.get_device_properties(index)
        report.device_name = props.name
        report.total_memory_bytes = props.total_memory
        report.device_count = torch.cuda.device_count()
        if torch.version.hip:
            report.platform = common_pb2.PLATFORM_ROCM
            report.gcn_arch = getattr(props, "gcnArchName", "").split(":")[0]
        else:
            report.platform = common_pb2.PLATFORM_CUDA
            report.compute_capability_major, report.compute_capability_minor = torch.cuda.get_device_capability(index)
    else:
        report.platform = common_pb2.PLATFORM_CPU
        report.device_name = _cpu_name()
        report.total_memory_bytes = _cpu_memory_bytes()
    for name, version in runnable_libraries(device).items():
        report.libraries.add(name=name, version=version)
    report.tensor_parallel_size = tensor_parallel_size()  # 1 unless started with --tensor-parallel-size
    return report


def runnable_libraries(device: torch.device) -> dict[str, str]:
    """Library -> version, for each library one of our backends needs and can run with on `device`."""
    found: dict[str, str] = {}
    for backend in IMPLEMENTATIONS:
        library = BACKENDS[backend].required_library
        if library in found or unavailable_reason(backend, device) is not None:
            continue
        found[library] = _library_version(library)
    return dict(sorted(found.items()))


def default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _library_version(library: str) -> str:
    if library == "torch":
        return torch.__version__
    if library == "flash_attn":
        from kernels import flash_attn

        return flash_attn.library_version() or "unknown"
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _cpu_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

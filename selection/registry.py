"""Backend names and the per-platform auto-selection order (rule R4)."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.capabilities import BACKEND_NAMES, Hardware, Platform

AUTO = "auto"


class UnknownBackendError(ValueError):
    def __init__(self, name: str) -> None:
        options = ", ".join((AUTO, *BACKEND_NAMES))
        super().__init__(f"Unknown attention backend: '{name}'. Valid options are: {options}")


def normalize_backend_name(name: str) -> str | None:
    """Upper-cased backend name, or None for auto ("" or "auto" in any case)."""
    cleaned = name.strip()
    if cleaned.lower() in ("", AUTO):
        return None
    upper = cleaned.upper()
    if upper not in BACKEND_NAMES:
        raise UnknownBackendError(name)
    return upper


@dataclass(frozen=True)
class PlatformPriority:
    platform: Platform
    condition: str
    backends: tuple[str, ...]


_CUDA_DEFAULT = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
_CUDA_SM10X_CAUSAL = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
_ROCM = ("ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN")
_CPU = ("CPU_ATTN",)

PRIORITIES: tuple[PlatformPriority, ...] = (
    PlatformPriority(Platform.CUDA, "compute capability 10.x, causal", _CUDA_SM10X_CAUSAL),
    # FlashInfer's non-causal (cutlass) path is known to misbehave for DFlash: FLASH_ATTN goes first.
    PlatformPriority(Platform.CUDA, "any other compute capability, or 10.x non-causal", _CUDA_DEFAULT),
    PlatformPriority(Platform.ROCM, "always", _ROCM),
    PlatformPriority(Platform.CPU, "always", _CPU),
)


def priority_list(hardware: Hardware, use_non_causal: bool) -> tuple[str, ...]:
    """The backends auto-selection tries, best first (R4)."""
    if hardware.platform is Platform.CUDA:
        if hardware.compute_capability[0] == 10 and not use_non_causal:
            return _CUDA_SM10X_CAUSAL
        return _CUDA_DEFAULT
    if hardware.platform is Platform.ROCM:
        return _ROCM
    return _CPU

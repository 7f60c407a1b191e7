"""Backend names as callers write them: "" or "auto" (any case) for auto-selection, else a known backend.
The per-platform auto-selection order (R4) is in rules.py."""

from __future__ import annotations

from kernels.capabilities import BACKEND_NAMES

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

"""Attention kernels over one paged KV cache, and the torch-free capability table the selector reads.

`kernels.paged_attention(backend, ...)` and `kernels.write_kv(...)` are the entry points (see
kernels/attention.py). Importing this package does not import torch: the selector imports
`kernels.capabilities` alone, and the torch-side names load on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "paged_attention": "kernels.attention",
    "unavailable_reason": "kernels.attention",
    "BackendUnavailableError": "kernels.attention",
    "write_kv": "kernels.kv_cache",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")

"""Where the fused small-M Triton GEMMs (kernels/small_gemm.py, kernels/qkv_rope_gemm.py) replace cuBLAS.

cuBLAS is the default: a fused kernel runs only for a (device, dtype, op, rows, N, K) that
bench/fused_layer_bench.py measured at least 5 % faster than the unfused ops it replaces, as recorded in
small_gemm_table.json (the bench's --write-table merges its winners there, with their tile shapes). Ops:

- "qkv_rope": (add +) RMSNorm, QKV GEMM, RoPE and K/V write, vs the add-norm kernel, cuBLAS, the RoPE + store kernel;
- "gate_up_silu": (add +) RMSNorm, gate/up GEMM, SiLU-and-mul, vs the add-norm kernel, cuBLAS, the SiLU kernel;
- "linear": a plain GEMM (o_proj, down_proj), vs cuBLAS.

Rows are bucketed to the next power of two (up to MAX_ROWS). SPECDEC_SMALL_GEMM overrides the table: "triton"
fuses every eligible shape (the kernel-count test, the bench's fused runs), "off" none. `trial_table` swaps the
whole table for a while: the bench's step-level trials, where a row count's fused kernels together can beat cuBLAS
in a step (programmatic dependent launch chains them) though none wins alone.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_ROWS = 64  # more rows (prefill) always go to cuBLAS
TABLE_PATH = Path(__file__).with_name("small_gemm_table.json")
POLICY_ENV = "SPECDEC_SMALL_GEMM"
POLICIES = ("table", "triton", "off")
OPS = ("qkv_rope", "gate_up_silu", "linear")


@dataclass(frozen=True)
class GemmConfig:
    """A fused kernel's tiles: columns per program (small_gemm), K step, warps; `gemv`: a few rows (decode's)
    summed on the CUDA cores in a program of exactly their bucket, instead of the tensor cores' 16-row MMA;
    `block_m`: rows per program. A GEMV's (0: all of them): a verify's 8 rows run as two programs of 4 rows (the
    second reads the weights from L2) instead of one whose products no longer fit in registers. An MMA's (0: 16,
    or 32 or 64): 32 rows in one program read each weight tile once, where two programs of 16 read it twice; `defer`
    (GEMV only, kernels/small_gemm.py): each thread keeps its own products' sums over the K steps and the program
    sums across its threads once at the end, instead of at every K step."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    gemv: bool = False
    block_m: int = 0
    defer: bool = False


DEFAULT_CONFIG = GemmConfig()


def rows_bucket(rows: int) -> int:
    return 1 << (max(1, rows) - 1).bit_length()


def table_key(op: str, rows: int, n: int, k: int) -> str:
    return f"{op}:{rows_bucket(rows)}:{n}:{k}"


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_name(index: int) -> str:
    """A GPU's name, asked of the driver once: every fused layer of an eager pass looks its tiles up by it (SmolLM2's
    eager prefill asked 120 times a forward)."""
    return torch.cuda.get_device_name(index)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def load_table(path: Path = TABLE_PATH) -> dict[str, Any]:
    """{device name: {dtype: {key: tile config}}}; the file's other keys are notes."""
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("devices", {})


_trial: dict[str, Any] | None = None  # trial_table's devices while it runs


@contextmanager
def trial_table(devices: dict[str, Any]) -> Iterator[None]:
    """`choose` reads `devices` ({device name: {dtype: {key: config}}}) instead of the file meanwhile."""
    global _trial
    previous, _trial = _trial, devices
    try:
        yield
    finally:
        _trial = previous


def policy() -> str:
    value = os.environ.get(POLICY_ENV, "table")
    if value not in POLICIES:
        raise ValueError(f"{POLICY_ENV}={value!r}: expected one of {', '.join(POLICIES)}")
    return value


def choose(op: str, rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemmConfig | None:
    """The fused kernel's tile config for this call, or None: the unfused ops (cuBLAS). On the CPU only under
    Triton's interpreter (the kernel tests), and only when the policy asks for it."""
    if op not in OPS:
        raise ValueError(f"unknown small-GEMM op {op!r}")
    if rows <= 0 or rows > MAX_ROWS or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    mode = policy()
    if mode == "off":
        return None
    table = load_table() if _trial is None else _trial
    entry = table.get(device_name(device), {}).get(dtype_name(dtype), {}).get(table_key(op, rows, n, k))
    if entry is not None:
        return GemmConfig(**entry)
    return DEFAULT_CONFIG if mode == "triton" else None


def merge_winners(
    winners: dict[str, dict[str, dict[str, Any]]], device: str, measured: dict[str, set[str]], path: Path = TABLE_PATH
) -> None:
    """Write a bench run's winners ({dtype: {key: config}}) for `device` into the table file. Every key the run
    timed (`measured`: {dtype: keys}) is replaced: a shape that lost this time loses its entry; shapes it did not
    time keep theirs."""
    document = json.loads(path.read_text()) if path.exists() else {}
    devices = document.setdefault("devices", {})
    for dtype, keys in measured.items():
        table = {key: entry for key, entry in devices.get(device, {}).get(dtype, {}).items() if key not in keys}
        table.update(winners.get(dtype, {}))
        devices.setdefault(device, {})[dtype] = dict(sorted(table.items()))
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    load_table.cache_clear()

"""What the benchmark scripts share: the synthetic model presets, the report's provenance (commit, versions,
device tag, file naming), timing and memory helpers, and the synthetic target request. Bench scripts import it
as `common` (bench/ is not a package; a script's own folder is on its import path)."""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc
import torch

from executor_service.server.wire import DTYPE_ENUMS, TORCH_DTYPES, resolve_dtype
from specdec.v1 import common_pb2, executor_pb2

REPO = Path(__file__).resolve().parent.parent

MODEL_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_size", "vocab")
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_size": 128,
        "vocab": 128256, "prompt_len": 128, "decode_tokens": 256, "batches": "32,128", "prefill_len": 4096,
        "prefill_batches": "1,4", "repeats": 3, "copy_mib": 2048,
    },
    "smollm2": {  # SmolLM2-135M's shape (tied embeddings), the target the shipped drafters serve
        "layers": 30, "hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "head_size": 64,
        "vocab": 49152, "prompt_len": 128, "decode_tokens": 256, "batches": "32,128", "prefill_len": 2048,
        "prefill_batches": "1,4", "repeats": 3, "copy_mib": 2048,
    },
    "tiny": {
        "layers": 2, "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 2, "head_size": 32,
        "vocab": 1024, "prompt_len": 32, "decode_tokens": 32, "batches": "4,16", "prefill_len": 512,
        "prefill_batches": "1,2", "repeats": 2, "copy_mib": 64,
    },
}  # fmt: skip
# --dtype names: the product's dtypes (executor_service.server.wire.TORCH_DTYPES), by torch's name
DTYPES = {str(t).removeprefix("torch."): enum for enum, t in sorted(TORCH_DTYPES.items(), key=lambda e: str(e[1]))}


# ---- output and provenance ---------------------------------------------------------------------------------------
def log(message: str) -> None:
    print(message, flush=True)


def commit_id() -> tuple[str, bool | None]:
    """SPECDEC_COMMIT (the GPU host's copy has no .git), else git; and whether tracked files differ from it."""
    commit = os.environ.get("SPECDEC_COMMIT")
    if commit:
        return commit, None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
        return commit, bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def provenance(benchmark: str, device: torch.device) -> dict[str, Any]:
    """A report's first keys: which benchmark, when, at which commit (and whether tracked files differed from
    it), on which device."""
    commit, dirty = commit_id()
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).split()  # "NVIDIA H100 80GB HBM3" -> "h100"
    return next((w.lower() for w in words if re.fullmatch(r"[A-Za-z]+\d+[A-Za-z]*", w)), words[-1].lower())


def write_result(out: Path, name: str, device: torch.device, commit: str, report: dict[str, Any]) -> Path:
    """OUT/NAME_DATE_DEVICE_COMMIT.json: the naming every bench/results file of these scripts follows."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{dt.date.today().isoformat()}_{device_tag(device)}_{commit}.json"
    path.write_text(json.dumps(report, indent=1))
    log(f"wrote {path}")
    return path


def versions() -> dict[str, Any]:
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
    }
    found["cuda"] = torch.version.cuda
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    try:
        from kernels import flash_attn

        fa = flash_attn.load()
        found["flash_attn"] = getattr(fa, "version", None) if fa else None
    except Exception:
        found["flash_attn"] = None
    return found


# ---- timing and memory -------------------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_graph(run: Any, device: torch.device, iters: int, warmup: int = 5) -> float:
    """Median ms of one `run()` (e.g. what the engine calls: buffer copies + replay) alone on an idle GPU, after
    `warmup` untimed runs (compiling, warming up): includes the host's launch latency, which a pipelined engine
    hides behind the previous pass. CUDA events on GPUs, the wall clock on the CPU."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> dict[str, float]:
    gc.collect()
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated_GiB": round(torch.cuda.memory_allocated(device) / 2**30, 3),
        "device_used_GiB": round((total - free) / 2**30, 3),
    }


def copy_bandwidth(device: torch.device, mib: int, iters: int) -> dict[str, Any]:
    """dst.copy_(src) of `mib` MiB: bandwidth = bytes read + bytes written per second (2 * size / time)."""
    size = mib * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
    del src, dst
    seconds = median(times)
    return {
        "bytes_per_copy": size,
        "bytes_moved_per_copy": 2 * size,
        "iterations": iters,
        "median_ms": round(seconds * 1e3, 4),
        "best_ms": round(min(times) * 1e3, 4),
        "GBps": round(2 * size / seconds / 1e9, 1),  # median; the floor uses this figure
        "GBps_best": round(2 * size / min(times) / 1e9, 1),
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
    }


# ---- workloads ---------------------------------------------------------------------------------------------------
def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """The same prompts in every process that asks (the gRPC client process included)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def default_dtype(device: torch.device) -> int:
    """The DType enum LoadModel uses when none is given (bf16 on GPUs, fp32 on the CPU)."""
    return DTYPE_ENUMS[resolve_dtype(common_pb2.DTYPE_UNSPECIFIED, device)]


def synthetic_eagle_load(
    shape: Mapping[str, int], k: int, dtype: int = common_pb2.DTYPE_FLOAT32, num_kv_blocks: int = 256
) -> executor_pb2.LoadModelRequest:
    """A synthetic target of `shape` (seed 0) and a one-layer synthetic EAGLE drafter of its shape (seed 7), the
    same on every executor that loads it."""
    target = synthetic_target(shape, seed=0)
    drafter = executor_pb2.SyntheticModel()
    drafter.CopyFrom(target)
    drafter.num_layers, drafter.seed = 1, 7
    return executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(synthetic=target),
        draft=executor_pb2.DraftModel(
            method=common_pb2.SPEC_METHOD_EAGLE,
            num_speculative_tokens=k,
            source=executor_pb2.ModelSource(synthetic=drafter),
        ),
        dtype=dtype,
        num_kv_blocks=num_kv_blocks,
    )


def synthetic_target(shape: Mapping[str, int], seed: int) -> executor_pb2.SyntheticModel:
    """A synthetic Llama target of `shape` (the MODEL_FIELDS of a preset)."""
    return executor_pb2.SyntheticModel(
        architecture="llama", vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_layers=shape["layers"], num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"], head_size=shape["head_size"], seed=seed,
    )  # fmt: skip

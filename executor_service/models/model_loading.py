"""Where a target comes from and how its weights are read, for everyone that loads one: LoadModel (session.py),
the other tensor-parallel ranks (parallel/worker.py) and the drafter trainer (specdec_training). It lives in the
models layer, free of the wire and of the composition root, so that none of them needs the others' machinery;
reading a ModelSource or a dtype enum into these is wire.py's business."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.errors import invalid_fields
from executor_service.models.config import ModelConfig
from executor_service.models.gguf_loader import is_gguf, load_gguf, read_gguf_config, resolve_gguf_path
from executor_service.models.limits import model_violations
from executor_service.models.loader import LoadedModel, build_synthetic, load_directory, read_config
from executor_service.models.model_paths import check_path_text, resolve_model_path
from executor_service.models.weights import echoing_target

TARGET_PATH_FIELD = "target.path"
# Benchmarks only ("1"): synthetic targets echo (weights.echoing_target), on every tensor-parallel rank. An
# environment variable, not a LoadModel field: a bench's knob stays off the API, and the other ranks' processes
# (parallel/worker.py) inherit it from rank 0's. bench/tp_bench.py --drafts always-right sets it (docs/parallelism.md).
ECHOING_TARGET_ENV = "SPECDEC_BENCH_ECHOING_TARGET"


@dataclass(frozen=True)
class TargetSource:
    config: ModelConfig
    path: Path | None  # None: synthetic
    seed: int = 0


def resolve_target_path(raw: str, model_root: Path | None, field: str) -> TargetSource:
    """The target a path names (a Hugging Face directory or a GGUF file under `model_root`, or `package:NAME`):
    its config is read, its weights not yet. InvalidField / UnmetPrecondition name `field` (and its attributes)."""
    check_path_text(raw, field)
    gguf = resolve_gguf_path(raw, model_root, field)
    if gguf is not None:
        config = read_gguf_config(gguf, field)
        problems = model_violations(config, lambda attr: f"{field}.{attr}")
        if problems:
            raise invalid_fields(problems)
        return TargetSource(config, gguf)
    path = resolve_model_path(raw, model_root, field)
    return TargetSource(read_config(path, field), path)


def default_dtype(device: torch.device) -> torch.dtype:
    """The weights' dtype where none is asked for: bfloat16 on GPUs, float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_target(
    source: TargetSource, dtype: torch.dtype, device: torch.device, field: str = TARGET_PATH_FIELD
) -> LoadedModel:
    """The target's full weights on `device` (every tensor-parallel rank runs this, then keeps its shard);
    errors about the files name `field`."""
    if source.path is None:
        loaded = build_synthetic(source.config, source.seed, dtype, device)
        if os.environ.get(ECHOING_TARGET_ENV) == "1":  # before any rank cuts it: the same echo on every rank
            echoing_target(loaded.model)
        return loaded
    if is_gguf(source.path):
        return load_gguf(source.path, dtype, device, field)
    return load_directory(source.path, dtype, device, field)

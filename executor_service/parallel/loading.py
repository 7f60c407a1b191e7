"""Each rank's shard of the target, read straight from a Hugging Face checkpoint.

From safetensors a rank reads only its slices (safetensors' `get_slice` reads those bytes alone), into a model
built with its shard's shapes: no rank ever holds the whole target. Rank 0 also reads the whole embedding and
LM head for its drafter. Synthetic and GGUF targets are built whole on the device, then cut (synthetic
weights are drawn in one sequence that must match a single-process run; GGUF tensors are quantized whole).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from executor_service.models.config import ModelConfig
from executor_service.models.gguf_loader import is_gguf
from executor_service.models.loader import LoadedModel, _unreadable_as, check_directory, load_tokenizer, read_config
from executor_service.models.model import DecoderModel
from executor_service.models.weights import Placement, hf_layout, materialize
from executor_service.parallel.driver import FullHeads
from executor_service.parallel.layers import shard_model, vocab_shard

FIELD = "target.path"
ROWS = ("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")  # column-parallel: a slice of the rows
COLUMNS = ("o_proj.weight", "down_proj.weight")  # row-parallel: a slice of the columns
VOCABULARY = ("embed_tokens.weight", "lm_head.weight")
RANK_0_ONLY = ("o_proj.bias",)  # added once, on rank 0


def load_target_shard(
    source_path: Path | None,
    load_whole: Callable[[], LoadedModel],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    keep_heads: bool,
) -> tuple[LoadedModel, FullHeads | None]:
    """This rank's shard, and (`keep_heads`) the whole embedding and LM head for a drafter on this rank.
    `load_whole`: builds the whole target on the device (synthetic, GGUF)."""
    if source_path is None or is_gguf(source_path):
        loaded = load_whole()
        heads = FullHeads(loaded.model) if keep_heads else None
        shard_model(loaded.model, rank, world_size)
        return loaded, heads
    config = read_config(source_path, FIELD)
    located = check_directory(source_path, config, FIELD)
    with torch.device("meta"):
        model = shard_model(DecoderModel(config), rank, world_size)
    model = materialize(model, config, dtype, device)
    for parameter in model.parameters():
        parameter.zero_()  # padded vocabulary rows and the other ranks' o_proj bias stay zero
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    layout = hf_layout(config)
    whole = _whole_heads(config, dtype, device) if keep_heads else None
    _load_slices(model, located, layout, rank, world_size, whole)
    heads = FullHeads(whole) if whole is not None else None  # type: ignore[arg-type]
    return LoadedModel(config, model, load_tokenizer(source_path, FIELD), str(source_path)), heads


def _whole_heads(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An empty whole embedding and LM head (tied where the target's are), filled by _load_slices."""
    holder = nn.Module()
    holder.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
    holder.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
    if config.tie_word_embeddings:
        holder.lm_head.weight = holder.embed_tokens.weight
    return holder.requires_grad_(False)


def _load_slices(
    model: DecoderModel,
    located: dict[str, Path],
    layout: dict[str, Placement],
    rank: int,
    world_size: int,
    whole: nn.Module | None,
) -> None:
    """Copy this rank's slice of each tensor of `layout` into the sharded `model`; the vocabulary's whole
    matrices into `whole` too, where given."""
    from safetensors import safe_open

    vocab = model.config.vocab_size
    for file in sorted(set(located.values())):
        with _unreadable_as(FIELD, file), safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                placement = layout.get(name)
                if placement is None or located[name] != file:
                    continue
                kind = ".".join(placement.parameter.split(".")[-2:])
                target = model.get_parameter(placement.parameter)
                part = handle.get_slice(name)
                if kind in ROWS:
                    rows = placement.shape[0] // world_size
                    start = placement.row_start // world_size
                    target[start : start + rows].copy_(part[rank * rows : (rank + 1) * rows])
                elif kind in COLUMNS:
                    columns = placement.shape[1] // world_size
                    target.copy_(part[:, rank * columns : (rank + 1) * columns])
                elif kind in VOCABULARY:
                    first, count, _ = vocab_shard(vocab, rank, world_size)
                    target[:count].copy_(part[first : first + count])
                    if whole is not None:  # rank 0's drafter: the whole matrix too
                        whole.get_parameter(placement.parameter).copy_(part[:vocab])
                elif kind not in RANK_0_ONLY or rank == 0:
                    target.copy_(part[:])

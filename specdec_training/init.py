"""A drafter ready to train: random weights from the seed, what the data decides, and a head start from
the target where the shapes allow it.

- EAGLE-3's reduced vocabulary: the `draft_vocab_size` tokens the target writes most often in the
  generated responses (ties: lower id), in id order; d2t maps them back (target id = id + d2t[id]) and
  t2d maps target ids to head rows (-1: outside the head). Its head starts as the target's LM head rows of
  those tokens, and its final norm as the target's.
- DFlash's mask token: the token the data uses least (ties: the highest id), so that MASK is something
  the target's embedding never had to mean; its final norm starts as the target's, whose LM head it uses.

Or a published drafter to go on training (`--init-from`, `pretrained_drafter`): its weights, EAGLE-3's
reduced vocabulary and DFlash's mask token are kept, so the fine-tuned drafter stays a drop-in replacement.
A DFlash or EAGLE-1 recipe with more layers than the published drafter grows it: the published layers come
first, and each new layer starts with its output projections (attention's o_proj, the MLP's down_proj) at zero,
so it adds nothing to the residual stream and the grown drafter drafts exactly what the published one did until
training moves it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import DraftConfig, draft_from_hf
from executor_service.models.draft_models import Drafter, Eagle3Drafter, TargetHeads
from executor_service.models.draft_weights import load_drafter, synthetic_drafter
from executor_service.models.loader import read_config_json
from executor_service.models.model import DecoderModel
from specdec.v1 import executor_pb2
from specdec_training.features import Sequence


def token_counts(sequences: list[Sequence], vocab_size: int) -> torch.Tensor:
    counts = Counter(token for s in sequences for token in s.response)
    values = torch.zeros(vocab_size, dtype=torch.int64)
    if counts:
        values[torch.tensor(list(counts))] = torch.tensor(list(counts.values()))
    return values


def least_used_token(sequences: list[Sequence], vocab_size: int) -> int:
    counts = Counter(token for s in sequences for token in s.ids)
    return min(range(vocab_size), key=lambda token: (counts.get(token, 0), -token))


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties: lower id), ascending."""
    order = sorted(range(counts.shape[0]), key=lambda token: (-int(counts[token]), token))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


INIT_FIELD = "--init-from"
SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_size")
GROWABLE = ("dflash", "eagle")  # drafters of a stack of decoder layers: --init-from may add layers on top
DRAFT_FIELDS = ("target_layer_ids", "draft_vocab_size", "block_size")


def vocab_maps(selected: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t [size] (target id - draft id) and t2d [vocab] (draft id, or -1)."""
    d2t = selected - torch.arange(selected.shape[0])
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[selected] = torch.arange(selected.shape[0])
    return d2t, t2d


def with_mask_token(config: DraftConfig, sequences: list[Sequence]) -> DraftConfig:
    if config.method != "dflash":
        return config
    return replace(config, mask_token_id=least_used_token(sequences, config.model.vocab_size))


@torch.no_grad()
def trainable_drafter(
    config: DraftConfig, target: DecoderModel, sequences: list[Sequence], seed: int, device: torch.device
) -> tuple[Drafter, torch.Tensor | None]:
    """The drafter in fp32 with gradients on, and EAGLE-3's t2d (None for the others)."""
    heads = TargetHeads(target.embed_tokens, target.lm_head)
    drafter = synthetic_drafter(config, heads, seed, torch.float32, device)
    t2d = None
    if isinstance(drafter, Eagle3Drafter):
        selected = draft_vocabulary(token_counts(sequences, config.model.vocab_size), config.draft_vocab_size)
        d2t, t2d = vocab_maps(selected, config.model.vocab_size)
        drafter.d2t.copy_(d2t)
        drafter.lm_head.weight.copy_(target.lm_head.weight[selected.to(target.lm_head.weight.device)])
        t2d = t2d.to(device)
    if hasattr(drafter, "norm"):
        drafter.norm.weight.copy_(target.norm.weight)
    return drafter.train().requires_grad_(True), t2d


def published_config(directory: Path, method: str, target: ModelConfig) -> DraftConfig:
    raw = read_config_json(directory, INIT_FIELD)
    return draft_from_hf(raw, method, target, executor_pb2.DraftModel(), INIT_FIELD)


def pretrained_config(directory: Path, recipe_config: DraftConfig, target: ModelConfig) -> DraftConfig:
    """The published drafter's config, which must have the recipe's shape (the recipe's flags change the
    optimization only), except that a growable drafter may have fewer layers than the recipe (the config then
    has the recipe's count); ValueError naming what differs."""
    config = published_config(directory, recipe_config.method, target)
    pairs = [(name, getattr(config.model, name), getattr(recipe_config.model, name)) for name in SHAPE_FIELDS]
    pairs += [(name, getattr(config, name), getattr(recipe_config, name)) for name in DRAFT_FIELDS]
    grows = config.method in GROWABLE and config.model.num_layers < recipe_config.model.num_layers
    differ = [
        f"{name} {mine} (recipe {wanted})"
        for name, mine, wanted in pairs
        if mine != wanted and not (grows and name == "num_layers")
    ]
    if differ:
        raise ValueError(f"{INIT_FIELD} {directory}: not the recipe's drafter: " + "; ".join(differ))
    return replace(config, model=replace(config.model, num_layers=recipe_config.model.num_layers))


@torch.no_grad()
def pretrained_drafter(
    directory: Path, config: DraftConfig, target: DecoderModel, device: torch.device, seed: int = 0
) -> tuple[Drafter, torch.Tensor | None]:
    """The published drafter in fp32 with gradients on (grown to config's layers, the new ones' other weights
    drawn from `seed`), and EAGLE-3's t2d from its own d2t."""
    heads = TargetHeads(target.embed_tokens, target.lm_head)
    published = published_config(directory, config.method, target.config).model.num_layers
    if published < config.model.num_layers:
        drafter = grown_drafter(directory, config, published, heads, seed, device)
    else:
        drafter = load_drafter(directory, config, heads, torch.float32, device, INIT_FIELD)
    t2d = None
    if isinstance(drafter, Eagle3Drafter):
        t2d = vocab_maps(drafter.target_ids().cpu(), config.model.vocab_size)[1].to(device)
    return drafter.train().requires_grad_(True), t2d


@torch.no_grad()
def grown_drafter(
    directory: Path, config: DraftConfig, published: int, heads: TargetHeads, seed: int, device: torch.device
) -> Drafter:
    """The published drafter's `published` layers, then new ones whose output projections are zero."""
    shallow_config = replace(config, model=replace(config.model, num_layers=published))
    shallow = load_drafter(directory, shallow_config, heads, torch.float32, device, INIT_FIELD)
    drafter = synthetic_drafter(config, heads, seed, torch.float32, device)
    missing, unexpected = drafter.load_state_dict(shallow.state_dict(), strict=False)
    new_layers = tuple(f"layers.{index}." for index in range(published, config.model.num_layers))
    assert not unexpected and all(name.startswith(new_layers) for name in missing), (missing, unexpected)
    for layer in drafter.layers[published:]:
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            projection.weight.zero_()
            if projection.bias is not None:
                projection.bias.zero_()
    return drafter

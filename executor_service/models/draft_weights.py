"""Drafter checkpoints: the published tensor layouts, loading, synthetic weights and export.

Names are as SafeAILab (EAGLE-1 `layers.*`, EAGLE-3 `midlayer.*`) and z-lab (DFlash) publish them,
without a `model.` prefix (one is accepted and stripped). A frozen `embed_tokens` copy or EAGLE-3's
`t2d` may be present and are ignored: the target's embedding is used. Id tables (`d2t`, `t2d`) are
range-checked at load (draft_id_tables.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from executor_service.cancellation import check_cancelled
from executor_service.models.draft_config import DraftConfig, dflash_hf_fields
from executor_service.models.draft_id_tables import check_id_tables
from executor_service.models.draft_models import DRAFTERS, Drafter, TargetHeads
from executor_service.models.loader import check_tensors, load_tensors, read_tensor_shapes, tensor_files
from executor_service.models.weights import Placement, export_state, layer_layout, materialize, place, synthetic_values

IGNORED = ("embed_tokens.weight", "t2d")


def draft_layout(config: DraftConfig) -> dict[str, Placement]:
    model = config.model
    hidden, layers = model.hidden_size, len(config.target_layer_ids)
    layout: dict[str, Placement] = {}
    if config.method == "eagle":
        layout["fc.weight"] = Placement("fc.weight", 0, (hidden, 2 * hidden))
        if config.fc_bias:
            layout["fc.bias"] = Placement("fc.bias", 0, (hidden,))
        for i in range(model.num_layers):
            layout.update(layer_layout(model, f"layers.{i}", f"layers.{i}", input_norm=i > 0))
    elif config.method == "eagle3":
        layout["fc.weight"] = Placement("fc.weight", 0, (hidden, layers * hidden))
        layout.update(layer_layout(model, "midlayer", "midlayer", input_size=2 * hidden))
        layout["midlayer.hidden_norm.weight"] = Placement("midlayer.hidden_norm.weight", 0, (hidden,))
        layout["norm.weight"] = Placement("norm.weight", 0, (hidden,))
        layout["lm_head.weight"] = Placement("lm_head.weight", 0, (config.draft_vocab_size, hidden))
        layout["d2t"] = Placement("d2t", 0, (config.draft_vocab_size,))
    else:
        layout["fc.weight"] = Placement("fc.weight", 0, (hidden, layers * hidden))
        layout["hidden_norm.weight"] = Placement("hidden_norm.weight", 0, (hidden,))
        layout["norm.weight"] = Placement("norm.weight", 0, (hidden,))
        for i in range(model.num_layers):
            layout.update(layer_layout(model, f"layers.{i}", f"layers.{i}"))
    return layout


def empty_drafter(config: DraftConfig, target: TargetHeads, dtype: torch.dtype, device: torch.device) -> Drafter:
    with torch.device("meta"):
        drafter = DRAFTERS[config.method](config)
    drafter = materialize(drafter, config.model, dtype, device)
    drafter.target = target
    return drafter


def checkpoint_name(name: str) -> str:
    return name.removeprefix("model.")


def check_drafter_checkpoint(
    directory: Path, config: DraftConfig, field: str
) -> tuple[dict[str, Path], DraftConfig, dict[str, Placement]]:
    """Every tensor the drafter needs is in the checkpoint with its shape (headers only, nothing loaded):
    where each one is, the config as the checkpoint settles it, and the layout to load."""
    located = tensor_files(directory, field)
    shapes = {checkpoint_name(name): shape for name, shape in read_tensor_shapes(located, field).items()}
    if config.method == "eagle":  # whether fc has a bias is what the checkpoint holds (configs disagree)
        config = replace(config, fc_bias="fc.bias" in shapes)
    layout = draft_layout(config)
    check_tensors(layout, shapes, field, ignored=IGNORED)
    tables = {checkpoint_name(name): name for name in located if checkpoint_name(name) in ("d2t", "t2d")}
    check_id_tables(located, config, field, tables)
    return located, config, layout


@torch.no_grad()
def load_drafter(
    directory: Path, config: DraftConfig, target: TargetHeads, dtype: torch.dtype, device: torch.device, field: str
) -> Drafter:
    located, config, layout = check_drafter_checkpoint(directory, config, field)
    drafter = empty_drafter(config, target, dtype, device)
    load_tensors(drafter, located, layout, field, rename=checkpoint_name)
    return drafter


@torch.no_grad()
def synthetic_drafter(
    config: DraftConfig, target: TargetHeads, seed: int, dtype: torch.dtype, device: torch.device
) -> Drafter:
    """Random weights from `seed` (the synthetic target's scales); EAGLE-3's d2t maps its reduced
    vocabulary onto a seeded random subset of the target's."""
    drafter = empty_drafter(config, target, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    num_layers = max(config.model.num_layers, 1)
    for name, placement in draft_layout(config).items():
        check_cancelled()
        shape = placement.shape
        if name == "d2t":
            chosen = torch.randperm(config.model.vocab_size, generator=generator, device=device)[: shape[0]]
            values = chosen.sort().values - torch.arange(shape[0], device=device)
        else:
            values = synthetic_values(name, shape, num_layers, generator, device)
        place(drafter, placement, values)
    return drafter


def save_drafter(drafter: Drafter, num_target_layers: int, directory: Path) -> None:
    """config.json and model.safetensors in the drafter's published format (tests, training output)."""
    from safetensors.torch import save_file

    config = drafter.config
    raw = config.model.to_hf()
    if config.method == "eagle":
        raw.update(architectures=["LlamaForCausalLM"], bias=config.fc_bias)
    elif config.method == "eagle3":
        raw.update(
            architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=config.draft_vocab_size,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids)},
        )
    else:
        raw.update(dflash_hf_fields(config, num_target_layers))
    state = export_state(drafter, draft_layout(config))
    raw["torch_dtype"] = str(state["fc.weight"].dtype).removeprefix("torch.")  # what the weights are stored in
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

"""Drafter checkpoints: the published tensor layouts, loading, synthetic weights and export.

Names are as SafeAILab (EAGLE-1 `layers.*`, EAGLE-3 `midlayer.*`) and z-lab (DFlash) publish them,
without a `model.` prefix (one is accepted and stripped). A frozen `embed_tokens` copy or EAGLE-3's
`t2d` may be present and are ignored: the target's embedding is used.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from executor_service.draft_config import DraftConfig, dflash_hf_fields
from executor_service.draft_models import DRAFTERS, Drafter, TargetHeads
from executor_service.loader import check_tensors, read_tensor_shapes, tensor_files
from executor_service.weights import Placement, layer_layout, place

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
    drafter = drafter.to_empty(device=device).to(dtype)
    drafter.rope = drafter.rope.__class__(config.model).to(device)  # buffers computed, not left empty
    drafter.target = target
    return drafter.eval().requires_grad_(False)


def place_tensor(drafter: nn.Module, placement: Placement, tensor: torch.Tensor) -> None:
    if placement.parameter == "d2t":  # a buffer of ids, not a parameter
        drafter.get_buffer("d2t").copy_(tensor.to(torch.int64))
    else:
        place(drafter, placement, tensor)


def checkpoint_name(name: str) -> str:
    return name.removeprefix("model.")


@torch.no_grad()
def load_drafter(
    directory: Path, config: DraftConfig, target: TargetHeads, dtype: torch.dtype, device: torch.device, field: str
) -> Drafter:
    from safetensors import safe_open

    located = tensor_files(directory, field)
    shapes = {checkpoint_name(name): shape for name, shape in read_tensor_shapes(located).items()}
    if config.method == "eagle":  # whether fc has a bias is what the checkpoint holds (configs disagree)
        config = replace(config, fc_bias="fc.bias" in shapes)
    layout = draft_layout(config)
    check_tensors(layout, shapes, field, ignored=IGNORED)
    drafter = empty_drafter(config, target, dtype, device)
    for file in sorted(set(located.values())):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                ours = checkpoint_name(name)
                if ours in layout and located[name] == file:
                    place_tensor(drafter, layout[ours], handle.get_tensor(name))
    return drafter


@torch.no_grad()
def synthetic_drafter(
    config: DraftConfig, target: TargetHeads, seed: int, dtype: torch.dtype, device: torch.device
) -> Drafter:
    """Random weights from `seed` (same scales as the synthetic target); EAGLE-3's d2t maps its reduced
    vocabulary onto a seeded random subset of the target's."""
    drafter = empty_drafter(config, target, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    num_layers = max(config.model.num_layers, 1)
    for name, placement in draft_layout(config).items():
        shape = placement.shape
        if name == "d2t":
            chosen = torch.randperm(config.model.vocab_size, generator=generator, device=device)[: shape[0]]
            values = chosen.sort().values - torch.arange(shape[0], device=device)
        elif name.endswith("norm.weight"):
            values = 1 + 0.1 * torch.randn(shape, generator=generator, device=device)
        elif name.endswith(".bias"):
            values = 0.1 * torch.randn(shape, generator=generator, device=device)
        else:
            residual_out = "o_proj" in name or "down_proj" in name
            gain = 16.0 if name == "lm_head.weight" else (1.0 / (2 * num_layers) if residual_out else 1.0)
            values = torch.randn(shape, generator=generator, device=device) * (gain / shape[1]) ** 0.5
        place_tensor(drafter, placement, values)
    return drafter


def export_drafter_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    state = {}
    for name, placement in draft_layout(drafter.config).items():
        if name == "d2t":
            state[name] = drafter.get_buffer("d2t").detach().cpu().contiguous()
            continue
        source = drafter.get_parameter(placement.parameter)
        rows = placement.shape[0]
        state[name] = source[placement.row_start : placement.row_start + rows].detach().cpu().contiguous()
    return state


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
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(export_drafter_state(drafter), str(directory / "model.safetensors"), metadata={"format": "pt"})

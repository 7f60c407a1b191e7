"""Where each Hugging Face tensor lives in our model, and synthetic weights from a seed (and the benchmarks'
echoing variant of them, `echoing_target`).

The layout is the one place that knows the fusions: q/k/v land in row ranges of `qkv_proj`, gate/up in
row ranges of `gate_up_proj`. Loading, validation and export all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from executor_service.cancellation import check_cancelled
from executor_service.models.config import ModelConfig
from executor_service.models.model import DecoderModel
from executor_service.models.rope import RotaryEmbedding

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclass(frozen=True)
class Placement:
    parameter: str  # our parameter's name
    row_start: int  # first row of the fused parameter this tensor fills
    shape: tuple[int, ...]  # the checkpoint tensor's shape


def hf_layout(config: ModelConfig) -> dict[str, Placement]:
    """Every tensor a Hugging Face checkpoint of `config` must hold -> where it goes."""
    hidden = config.hidden_size
    layout = {
        "model.embed_tokens.weight": Placement("embed_tokens.weight", 0, (config.vocab_size, hidden)),
        "model.norm.weight": Placement("norm.weight", 0, (hidden,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = Placement("lm_head.weight", 0, (config.vocab_size, hidden))
    for i in range(config.num_layers):
        layout.update(layer_layout(config, f"model.layers.{i}", f"layers.{i}"))
    return layout


def layer_layout(
    config: ModelConfig, hf: str, ours: str, input_size: int | None = None, input_norm: bool = True
) -> dict[str, Placement]:
    """One decoder layer's tensors (`hf` and `ours`: the layer's name prefixes). Drafters reuse it:
    EAGLE-3's attention reads [embedding; hidden] (`input_size` 2H), EAGLE-1's first layer has no input norm."""
    hidden, inter, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    width = input_size or hidden
    layout: dict[str, Placement] = {}
    if input_norm:
        layout[f"{hf}.input_layernorm.weight"] = Placement(f"{ours}.input_layernorm.weight", 0, (hidden,))
    layout[f"{hf}.post_attention_layernorm.weight"] = Placement(f"{ours}.post_attention_layernorm.weight", 0, (hidden,))
    kinds = ["weight", "bias"] if config.attention_bias else ["weight"]
    for kind in kinds:
        rows = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        for name, (start, size) in rows.items():
            shape = (size, width) if kind == "weight" else (size,)
            layout[f"{hf}.self_attn.{name}.{kind}"] = Placement(f"{ours}.self_attn.qkv_proj.{kind}", start, shape)
        o_shape = (hidden, q) if kind == "weight" else (hidden,)
        layout[f"{hf}.self_attn.o_proj.{kind}"] = Placement(f"{ours}.self_attn.o_proj.{kind}", 0, o_shape)
    if config.architecture == "qwen3":
        for name in ("q_norm", "k_norm"):
            layout[f"{hf}.self_attn.{name}.weight"] = Placement(
                f"{ours}.self_attn.{name}.weight", 0, (config.head_size,)
            )
    layout[f"{hf}.mlp.gate_proj.weight"] = Placement(f"{ours}.mlp.gate_up_proj.weight", 0, (inter, hidden))
    layout[f"{hf}.mlp.up_proj.weight"] = Placement(f"{ours}.mlp.gate_up_proj.weight", inter, (inter, hidden))
    layout[f"{hf}.mlp.down_proj.weight"] = Placement(f"{ours}.mlp.down_proj.weight", 0, (hidden, inter))
    return layout


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """The model with uninitialized weights on `device` (no time spent on an init we overwrite)."""
    with torch.device("meta"):
        model = DecoderModel(config)
    model = materialize(model, config, dtype, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def materialize(module: ModuleT, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModuleT:
    """A module built on the meta device, given uninitialized storage on `device` and its RoPE tables
    computed (buffers are not left empty); frozen for inference."""
    module = module.to_empty(device=device).to(dtype)
    module.rope = RotaryEmbedding(config, dtype).to(device)
    return module.eval().requires_grad_(False)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """A parameter, or a buffer (EAGLE-3's d2t)."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def place(module: nn.Module, placement: Placement, tensor: torch.Tensor) -> None:
    target = _tensor(module, placement.parameter)
    rows = placement.shape[0]
    target[placement.row_start : placement.row_start + rows].copy_(tensor)


def synthetic_values(
    name: str, shape: tuple[int, ...], num_layers: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A random tensor for checkpoint tensor `name` (target or drafter), drawn from `generator`.

    Scales keep activations O(1) through depth and make logits peaked enough that greedy choices are
    not decided by rounding: embeddings N(0, 1), projections N(0, 1/fan_in), an LM head N(0, 16/fan_in),
    norms 1 with a little noise so a missed norm shows in tests.
    """
    if name.endswith("norm.weight"):
        return 1 + 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=generator, device=device)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=generator, device=device)
    residual_out = "o_proj" in name or "down_proj" in name
    gain = 16.0 if name == "lm_head.weight" else (1.0 / (2 * num_layers) if residual_out else 1.0)
    return torch.randn(shape, generator=generator, device=device) * (gain / shape[1]) ** 0.5


@torch.no_grad()
def synthetic_model(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """Random weights from `seed`, drawn on `device` in a fixed order (same seed and device: same model)."""
    model = empty_model(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, placement in hf_layout(config).items():
        check_cancelled()
        place(model, placement, synthetic_values(name, placement.shape, config.num_layers, generator, device))
    return model


ECHO_EMBEDDING_SCALE = 4.0  # the token's embedding over the layers' sum in the residual stream (both ~N(0, 1) each)


@torch.no_grad()
def echoing_target(model: nn.Module) -> None:
    """Make a synthetic target's greedy next token its newest token, ahead of the runner-up by tens of logits: the
    embeddings grow (the residual stream is mostly the newest token's) and the LM head is the embedding over
    sqrt(hidden) (the token's own logit ~sqrt(hidden), another's ~N(0, 1)). Shapes, kernels and cost are
    unchanged (values never change a pass's cost); the synthetic drafters' own heads and layers still draft
    other tokens (acceptance ~0). Benchmarks only: bench/specdec_bench.py calls it, and every tensor-parallel
    rank's load where SPECDEC_BENCH_ECHOING_TARGET is set (model_loading.load_target), so that an always-right
    drafter (tests/executor/spec_builders.EchoDrafts) stays right.

    Why: a random target's greedy choice hinges on near ties (128k logits), and bf16 rounding decides them
    differently per step shape (a decode step against a verify pass of k + 1 rows, a graph against eager; on the
    H100 the synthetic drafter's batch-16 run kept only 2 of 16 requests identical to target-only's, ~37 common
    tokens of 128). A script replayed from a fixed-k run then goes wrong for a request from its first flip on
    (the drafts continue a text it no longer has) as soon as adaptive speculation changes k; adaptive, seeing
    acceptance ~0, chose k = 0, which flips more: the 2026-11-28 H100 run of specdec_bench's (d) measured
    acceptance 0.012 per depth and batch-64 requests finishing apart for the drafter that was right at fixed k."""
    embed = model.embed_tokens.weight
    if model.lm_head.weight is not embed:  # untied: the head echoes the embedding
        model.lm_head.weight.copy_(embed * embed.shape[1] ** -0.5)
    embed.mul_(ECHO_EMBEDDING_SCALE)  # tied: the head grows with it (a larger margin, the same argmax)


def export_state(module: nn.Module, layout: dict[str, Placement]) -> dict[str, torch.Tensor]:
    """`module`'s tensors under checkpoint names (fused parameters split back), contiguous, on the CPU."""
    state = {}
    for name, placement in layout.items():
        source = _tensor(module, placement.parameter)
        rows = placement.shape[0]
        state[name] = source[placement.row_start : placement.row_start + rows].detach().cpu().contiguous()
    return state


def export_hf_state(model: DecoderModel) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face names."""
    return export_state(model, hf_layout(model.config))

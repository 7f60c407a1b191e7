"""Default training recipes per method, and the drafter config a recipe gives for a target.

Sized for SmolLM2-135M (hidden 576, 30 layers, vocabulary 49152) so that the shipped EAGLE-3 and DFlash
drafters together stay under 30 MB in bf16 (`published_bytes`): every drafter borrows the target's
embedding; DFlash and EAGLE-1 its LM head too, while EAGLE-3's own head covers the 8192 tokens the
target writes most often. Attention heads follow the target's. Each field can be changed on the
command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import (
    DraftConfig,
    default_dflash_layers,
    default_eagle3_layers,
    finish_draft_config,
)
from specdec.v1 import executor_pb2
from specdec_training.losses import LossSettings


@dataclass(frozen=True)
class Recipe:
    method: str  # "eagle" | "eagle3" | "dflash"
    # the drafter
    num_layers: int
    intermediate_size: int
    num_feature_layers: int = 0  # DFlash: target layers read, spread as z-lab does (EAGLE-3: low/mid/high)
    draft_vocab_size: int = 0  # EAGLE-3's reduced head
    block_size: int = 0  # DFlash
    # the optimization
    epochs: float = 2.0
    batch_size: int = 16  # sequences per step
    max_len: int = 768  # tokens per sequence (prompt + response), longer ones cut
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_ratio: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss: LossSettings = field(default_factory=LossSettings)


RECIPES = {
    # EAGLE-1 as SafeAILab trains it (feature smooth-L1 + 0.1 token CE), one full-width layer.
    "eagle": Recipe("eagle", num_layers=1, intermediate_size=1536, lr=3e-4, loss=LossSettings(ttt_steps=1)),
    # EAGLE-3: training-time test over 7 steps (weights 0.8^j), 8k-token head.
    "eagle3": Recipe(
        "eagle3", num_layers=1, intermediate_size=1024, draft_vocab_size=8192, loss=LossSettings(ttt_steps=7)
    ),
    # DFlash: 2 layers over 3 target layers, block 16 (k up to 15), 64 anchors a sequence, gamma 7.
    "dflash": Recipe(
        "dflash",
        num_layers=2,
        intermediate_size=768,
        num_feature_layers=3,
        block_size=16,
        loss=LossSettings(num_anchors=64, gamma=7.0),
    ),
}


def with_overrides(recipe: Recipe, **changes: object) -> Recipe:
    """`recipe` with the given fields changed (None: keep); LossSettings fields are accepted too."""
    loss_fields = set(LossSettings.__dataclass_fields__)
    given = {k: v for k, v in changes.items() if v is not None}
    loss = replace(recipe.loss, **{k: v for k, v in given.items() if k in loss_fields})
    return replace(recipe, loss=loss, **{k: v for k, v in given.items() if k not in loss_fields})


def draft_config(recipe: Recipe, target: ModelConfig, mask_token_id: int = -1) -> DraftConfig:
    """The drafter a recipe trains for `target`, checked as LoadModel checks a drafter."""
    model = replace(
        target,
        architecture="qwen3" if recipe.method == "dflash" else "llama",  # z-lab's DFlash layers are Qwen3's
        intermediate_size=recipe.intermediate_size,
        num_layers=recipe.num_layers,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(),
        bos_token_id=None,
        extra={},
    )
    if recipe.method == "dflash":
        count = recipe.num_feature_layers or recipe.num_layers
        layers = default_dflash_layers(target.num_layers, count)
    elif recipe.method == "eagle3":
        layers = default_eagle3_layers(target.num_layers)
    else:
        layers = ()
    config = DraftConfig(
        method=recipe.method,
        model=model,
        target_layer_ids=layers,
        draft_vocab_size=min(recipe.draft_vocab_size, target.vocab_size) if recipe.method == "eagle3" else 0,
        fc_bias=recipe.method == "eagle",
        block_size=recipe.block_size,
        mask_token_id=mask_token_id,
    )
    return finish_draft_config(config, target, executor_pb2.DraftModel(), "recipe")


def parameter_count(config: DraftConfig) -> int:
    """Parameters the published checkpoint holds (the borrowed embedding and LM head excluded)."""
    model = config.model
    hidden, inter = model.hidden_size, model.intermediate_size
    attention_in = 2 * hidden if config.method == "eagle3" else hidden
    attention = attention_in * (model.q_size + 2 * model.kv_size) + model.q_size * hidden
    norms = 2 * hidden + (2 * model.head_size if model.architecture == "qwen3" else 0)
    layer = attention + 3 * hidden * inter + norms
    if config.method == "eagle":
        return 2 * hidden * hidden + (hidden if config.fc_bias else 0) + model.num_layers * layer - hidden
    features = len(config.target_layer_ids) * hidden * hidden
    if config.method == "eagle3":
        return features + layer + hidden + hidden + config.draft_vocab_size * hidden  # hidden_norm, norm, head
    return features + 2 * hidden + model.num_layers * layer  # hidden_norm, norm


def published_bytes(config: DraftConfig, bytes_per_value: int = 2) -> int:
    """model.safetensors' tensor bytes in bf16/fp16 (EAGLE-3's d2t is int64)."""
    d2t = 8 * config.draft_vocab_size if config.method == "eagle3" else 0
    return parameter_count(config) * bytes_per_value + d2t

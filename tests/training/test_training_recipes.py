"""The default recipes fit the size budget for SmolLM2-135M, the size arithmetic is the checkpoint's, and
what the data decides at initialization (EAGLE-3's vocabulary, DFlash's mask token) is as specified."""

from __future__ import annotations

import pytest
import torch
from executor_builders import tiny_model

from executor_service.models.draft_models import TargetHeads
from executor_service.models.draft_weights import draft_layout, synthetic_drafter
from executor_service.models.weights import export_state
from specdec_training.features import Sequence
from specdec_training.init import (
    draft_vocabulary,
    least_used_token,
    token_counts,
    trainable_drafter,
    vocab_maps,
)
from specdec_training.recipes import RECIPES, draft_config, published_bytes, with_overrides
from specdec_training.target import synthetic_spec, target_source

SMOLLM2 = target_source("synthetic:smollm2").config


def test_shipped_eagle3_and_dflash_fit_in_30_mb_of_bf16_and_read_spread_layers() -> None:
    eagle3, dflash = draft_config(RECIPES["eagle3"], SMOLLM2), draft_config(RECIPES["dflash"], SMOLLM2, 0)
    assert published_bytes(eagle3) + published_bytes(dflash) < 30e6
    assert eagle3.target_layer_ids == (1, 14, 26) and eagle3.draft_vocab_size == 8192
    assert (
        dflash.target_layer_ids == (1, 14, 27)
        and dflash.block_size == 16
        and dflash.num_steps == dflash.num_draft_tokens == 15
    )
    assert dflash.model.architecture == "qwen3" and dflash.model.hidden_size == SMOLLM2.hidden_size


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_published_bytes_are_the_checkpoints(method: str) -> None:
    target = tiny_model().model
    recipe = with_overrides(RECIPES[method], intermediate_size=96, draft_vocab_size=100, num_layers=None)
    config = draft_config(recipe, target.config, mask_token_id=3)
    heads = TargetHeads(target.embed_tokens, target.lm_head)
    state = export_state(synthetic_drafter(config, heads, 0, torch.bfloat16, torch.device("cpu")), draft_layout(config))
    assert published_bytes(config) == sum(t.numel() * t.element_size() for t in state.values())


def test_overrides_reach_the_loss_settings_and_leave_the_rest() -> None:
    recipe = with_overrides(RECIPES["dflash"], lr=1e-3, gamma=4.0, num_anchors=None)
    assert recipe.lr == 1e-3 and recipe.loss.gamma == 4.0 and recipe.loss.num_anchors == 64
    assert recipe.num_layers == RECIPES["dflash"].num_layers


def test_eagle3_vocabulary_is_the_most_written_tokens_and_maps_both_ways() -> None:
    sequences = [Sequence([9, 9, 9], [5, 5, 5, 2, 2, 7]), Sequence([1], [7, 5, 3])]
    counts = token_counts(sequences, 10)  # responses only: 5 x4, 7 x2, 2 x2, 3 x1
    assert counts.tolist() == [0, 0, 2, 1, 0, 4, 0, 2, 0, 0]
    selected = draft_vocabulary(counts, 3)
    assert selected.tolist() == [2, 5, 7]  # ties by lower id: 2 before 7 is not needed, both fit
    d2t, t2d = vocab_maps(selected, 10)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 7]
    assert t2d.tolist() == [-1, -1, 0, -1, -1, 1, -1, 2, -1, -1]
    assert draft_vocabulary(counts, 2).tolist() == [2, 5]  # 2 and 7 tie at 2: the lower id wins
    assert least_used_token(sequences, 10) == 8  # unused: 0, 4, 6, 8 -> the highest


def test_a_trainable_eagle3_starts_from_the_targets_head_rows() -> None:
    target = tiny_model().model
    recipe = with_overrides(RECIPES["eagle3"], intermediate_size=96, draft_vocab_size=4)
    config = draft_config(recipe, target.config)
    drafter, t2d = trainable_drafter(config, target, [Sequence([1], [40, 40, 41, 42, 43, 43])], 0, torch.device("cpu"))
    assert (torch.arange(4) + drafter.d2t).tolist() == [40, 41, 42, 43]
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[40:44])
    assert torch.equal(drafter.norm.weight, target.norm.weight) and t2d is not None and int(t2d[42]) == 2
    assert all(p.requires_grad and p.dtype == torch.float32 for p in drafter.parameters()) and drafter.training


def test_synthetic_target_specs() -> None:
    spec = synthetic_spec("synthetic:tiny,seed=3,num_layers=4")
    assert (spec["seed"], spec["num_layers"], spec["vocab_size"], spec["architecture"]) == (3, 4, 512, "llama")
    with pytest.raises(ValueError, match="unknown synthetic preset 'huge'"):
        synthetic_spec("synthetic:huge")

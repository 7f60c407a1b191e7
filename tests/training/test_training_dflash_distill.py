"""DFlash's distillation (--distill): the target's top-K teacher computed with the labels, the loss against it at
the scored slots, and that nothing changes without it. The expected values are computed here the plain way
(the full softmax, a loop over anchors and slots), so a slip in gathering positions or ids fails."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from random_text import tiny_target_and_text

from executor_service.models.draft_models import DFlashDrafter
from executor_service.models.model import DecoderModel
from specdec_training.features import TEACHER_TOP_K, Sequence, TargetView, collate, target_view
from specdec_training.init import trainable_drafter, with_mask_token
from specdec_training.losses import LossOutput, LossSettings, dflash_loss, sample_anchors
from specdec_training.recipes import RECIPES, draft_config, with_overrides
from specdec_training.trainer import Trainer
from specdec_training.unroll import dflash_blocks

CPU = torch.device("cpu")
ANCHOR_SEED = 5


def tiny_dflash(
    seed: int, response_lengths: tuple[int, ...], **changes: object
) -> tuple[DecoderModel, list[Sequence], DFlashDrafter]:
    """The tiny target (512 ids), sequences of a 3-token prompt and random responses of these lengths, and a
    one-layer DFlash drafter of block 4 over two of its layers."""
    target, sequences = tiny_target_and_text(seed, response_lengths)
    recipe = with_overrides(
        RECIPES["dflash"], num_layers=1, intermediate_size=96, num_feature_layers=2, block_size=4, **changes
    )
    config = with_mask_token(draft_config(recipe, target.config, mask_token_id=0), sequences)
    drafter, _ = trainable_drafter(config, target, sequences, 0, CPU)
    assert isinstance(drafter, DFlashDrafter)
    return target, sequences, drafter


def loss_of(drafter: DFlashDrafter, view: TargetView, settings: LossSettings) -> LossOutput:
    return dflash_loss(drafter, view, settings, torch.Generator().manual_seed(ANCHOR_SEED))


def previous_dflash_loss(drafter: DFlashDrafter, view: TargetView, settings: LossSettings) -> LossOutput:
    """dflash_loss as it was before distillation (F.cross_entropy on the fp32 logits), for comparison."""
    size = drafter.config.block_size
    anchors, real = sample_anchors(view, settings.num_anchors, torch.Generator().manual_seed(ANCHOR_SEED))
    hidden = dflash_blocks(drafter, view.ids, view.features, anchors)[:, :, 1:]
    label_positions = anchors[..., None] + torch.arange(size - 1)
    within = label_positions < view.ids.shape[1]
    label_positions = label_positions.clamp(max=view.ids.shape[1] - 1)
    flat = label_positions.flatten(1)
    labels = view.labels.gather(1, flat).view_as(label_positions)
    valid = view.valid.gather(1, flat).view_as(label_positions) & within & real[..., None]
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / settings.gamma)
    logits = drafter.target.lm_head(hidden[valid]).float()
    per_token = F.cross_entropy(logits, labels[valid], reduction="none")
    row_weights = weights.expand_as(valid)[valid]
    loss = (per_token * row_weights).sum() / row_weights.sum().clamp(min=1e-6)
    correct = torch.zeros_like(valid)
    correct[valid] = logits.argmax(-1) == labels[valid]
    values = {"loss": loss.detach(), "ce": per_token.detach().sum() / max(per_token.numel(), 1)}
    for slot in range(size - 1):
        here = valid[..., slot]
        values[f"acc_{slot}"] = (correct[..., slot] & here).sum() / here.sum().clamp(min=1)
    leading = correct.int().cumprod(dim=-1).sum(dim=-1).float()
    values["accept_length"] = 1 + (leading * valid[..., 0]).sum() / valid[..., 0].sum().clamp(min=1)
    return LossOutput(loss, values)


def full_softmax(target: DecoderModel, view: TargetView) -> torch.Tensor:
    """[B, L, V]: the target's whole next-token distribution at T = 1 (fine at this size)."""
    return target.compute_logits(view.hidden.flatten(0, 1)).view(*view.ids.shape, -1).float().softmax(-1)


def test_without_distillation_the_loss_and_metrics_are_exactly_as_before() -> None:
    target, sequences, drafter = tiny_dflash(seed=1, response_lengths=(7, 11))
    batch = collate(sequences, 64, CPU)
    settings = LossSettings(num_anchors=6, gamma=3.0)
    before = previous_dflash_loss(drafter, target_view(target, drafter.config, batch), settings)
    for teacher_k in (0, TEACHER_TOP_K):  # a teacher computed but not asked for changes nothing either
        out = loss_of(drafter, target_view(target, drafter.config, batch, teacher_k=teacher_k), settings)
        assert out.loss.item() == before.loss.item()
        assert out.metrics == before.metrics


def test_the_teacher_is_the_targets_top_k_renormalized() -> None:
    target, sequences, drafter = tiny_dflash(seed=2, response_lengths=(5, 9))
    view = target_view(target, drafter.config, collate(sequences, 64, CPU), teacher_k=TEACHER_TOP_K)
    assert view.teacher_ids is not None and view.teacher_probs is not None
    assert view.teacher_ids.shape == view.teacher_probs.shape == (*view.ids.shape, TEACHER_TOP_K)
    assert view.teacher_ids.dtype == torch.int64 and view.teacher_probs.dtype == torch.float32
    full = full_softmax(target, view)
    kept = full.gather(-1, view.teacher_ids)
    dropped = full.scatter(-1, view.teacher_ids, -1.0)  # the ids not kept, and -1 where kept
    assert bool((kept.min(-1).values >= dropped.max(-1).values).all())  # the K most likely
    assert bool((view.teacher_ids.sort(-1).values.diff(dim=-1) > 0).all())  # K distinct ids
    assert torch.allclose(view.teacher_probs.sum(-1), torch.ones(view.ids.shape), atol=1e-5)
    torch.testing.assert_close(view.teacher_probs, kept / kept.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6)
    assert 0.05 < float(kept.sum(-1).mean()) < 0.99  # K < V really drops mass here: renormalizing matters


def test_full_distillation_is_the_soft_cross_entropy_against_the_top_k_at_the_scored_slots() -> None:
    """distill = 1: at every scored slot (anchor a, slot i predicting token a + i, read at position a + i - 1),
    -sum_k p_k log q(id_k) over the target's top K there, weighted exp(-(i - 1) / gamma)."""
    target, sequences, drafter = tiny_dflash(seed=3, response_lengths=(8, 12))
    k, gamma, size = 16, 3.0, drafter.config.block_size
    view = target_view(target, drafter.config, collate(sequences, 64, CPU), teacher_k=k)
    out = loss_of(drafter, view, LossSettings(num_anchors=6, gamma=gamma, distill=1.0))

    anchors, real = sample_anchors(view, 6, torch.Generator().manual_seed(ANCHOR_SEED))
    with torch.no_grad():
        blocks = dflash_blocks(drafter, view.ids, view.features, anchors)
    full = full_softmax(target, view)
    weighted, weights, soft_ces = 0.0, 0.0, []
    for row in range(view.ids.shape[0]):
        for index in range(anchors.shape[1]):
            anchor = int(anchors[row, index])
            for slot in range(1, size):
                position = anchor + slot - 1
                if not real[row, index] or position >= view.ids.shape[1] or not view.valid[row, position]:
                    continue
                top = full[row, position].topk(k)
                teacher = top.values / top.values.sum()
                with torch.no_grad():
                    log_q = drafter.target.lm_head(blocks[row, index, slot]).float().log_softmax(-1)
                soft_ce = -float((teacher * log_q[top.indices]).sum())
                weight = math.exp(-(slot - 1) / gamma)
                weighted, weights = weighted + weight * soft_ce, weights + weight
                soft_ces.append(soft_ce)
    assert len(soft_ces) >= 15
    assert out.loss.item() == pytest.approx(weighted / weights, rel=1e-5)
    assert out.metrics["soft_ce"] == pytest.approx(sum(soft_ces) / len(soft_ces), rel=1e-5)
    greedy = loss_of(drafter, view, LossSettings(num_anchors=6, gamma=gamma))
    half = loss_of(drafter, view, LossSettings(num_anchors=6, gamma=gamma, distill=0.5))
    assert "soft_ce" not in greedy.metrics and out.metrics["ce"] == greedy.metrics["ce"]
    assert half.loss.item() == pytest.approx((greedy.loss.item() + out.loss.item()) / 2, rel=1e-5)
    assert out.loss.item() != pytest.approx(greedy.loss.item(), rel=1e-3)


def test_padding_changes_no_distillation_loss_or_metric() -> None:
    """As for EAGLE-3 (test_training_losses.py): padding is never scored. More anchors than positions makes every
    eligible position an anchor, so the draw (random scores over the batch's width) picks the same ones."""
    target, sequences, drafter = tiny_dflash(seed=4, response_lengths=(6, 10))
    settings = LossSettings(num_anchors=64, gamma=3.0, distill=0.5)
    outs = {}
    for multiple in (1, 8, 64):
        batch = collate(sequences, 24, CPU, pad_multiple=multiple)
        view = target_view(target, drafter.config, batch, teacher_k=TEACHER_TOP_K)
        outs[batch.ids.shape[1]] = loss_of(drafter, view, settings)
    assert list(outs) == [13, 16, 24]  # 13 tokens; 64 is capped at max_len
    assert "soft_ce" in outs[13].metrics
    for width, out in outs.items():
        assert out.loss.item() == pytest.approx(outs[13].loss.item(), rel=1e-5), width
        for name, value in outs[13].metrics.items():
            assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (width, name)


def test_the_trainer_asks_for_the_teacher_when_a_dflash_recipe_distills() -> None:
    target, sequences, drafter = tiny_dflash(seed=5, response_lengths=(6, 9, 7))
    recipe = with_overrides(RECIPES["dflash"], batch_size=3, num_anchors=4, distill=0.5)
    trainer = Trainer(drafter, target, sequences, recipe, 0, CPU, progress=False, pad_multiple=1)
    assert trainer.teacher_k == TEACHER_TOP_K and trainer.soft_ids is None
    assert "soft_ce" in trainer.train_step() and "soft_ce" in trainer.evaluate(sequences)
    plain = Trainer(drafter, target, sequences, RECIPES["dflash"], 0, CPU, progress=False, pad_multiple=1)
    assert plain.teacher_k == 0 and "soft_ce" not in plain.evaluate(sequences)

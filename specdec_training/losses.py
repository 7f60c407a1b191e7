"""The three drafters' losses, and what each batch says about acceptance.

- EAGLE-1: per unrolled step, smooth-L1 between the drafter's output and the target's next feature
  (weight `feature_weight`) plus cross-entropy of the target's LM head on it (weight `token_weight`).
- EAGLE-3: per step, cross-entropy of its own head against the target's tokens mapped into the reduced
  vocabulary (t2d); tokens outside it are not scored. Step j weighs `step_decay ** j`.
- DFlash: random anchors in the response; cross-entropy of slots 1 .. B-1, slot i weighted by
  exp(-(i - 1) / gamma).
- Distillation (`distill` w > 0, EAGLE-3 and DFlash): (1 - w) x that cross-entropy + w x cross-entropy against
  the target's distribution: over EAGLE-3's draft vocabulary, or the target's top-K tokens for DFlash (whose
  drafter scores the whole vocabulary; see features.TEACHER_TOP_K).

`accept_length` is, over the scored rows, 1 + the mean number of leading correct drafts: what greedy
verification would accept there (exact for DFlash's block and for the unrolled chain, given the target's
tokens as context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_service.models.draft_models import DFlashDrafter, Drafter, Eagle3Drafter, EagleDrafter
from specdec_training.features import TargetView, shifted
from specdec_training.unroll import dflash_blocks, eagle_unroll

IGNORE = -100


@dataclass(frozen=True)
class LossSettings:
    ttt_steps: int = 1  # EAGLE / EAGLE-3 unrolled steps
    step_decay: float = 0.8
    feature_weight: float = 1.0  # EAGLE-1
    token_weight: float = 0.1  # EAGLE-1
    num_anchors: int = 32  # DFlash, per sequence
    gamma: float = 7.0  # DFlash
    # EAGLE-3 and DFlash: the share of the loss that is distillation, cross-entropy against the target's
    # distribution (EAGLE-3: over its draft vocabulary, view.soft; DFlash: the target's top-K, view.teacher_*)
    # instead of its greedy token: sampled requests accept by how much of the target's distribution the drafter
    # covers, which greedy labels alone do not teach. 0: greedy labels only.
    distill: float = 0.0


@dataclass
class LossOutput:
    loss: torch.Tensor
    values: dict[str, torch.Tensor]  # per-step / per-slot accuracies, accept_length, loss parts: 0-d, on the device

    @property
    def metrics(self) -> dict[str, float]:
        return read_metrics(self.values)


def drafter_loss(
    drafter: Drafter,
    view: TargetView,
    settings: LossSettings,
    generator: torch.Generator,
    t2d: torch.Tensor | None = None,
) -> LossOutput:
    if isinstance(drafter, DFlashDrafter):
        return dflash_loss(drafter, view, settings, generator)
    return eagle_loss(drafter, view, settings, t2d)


def eagle_loss(
    drafter: EagleDrafter | Eagle3Drafter, view: TargetView, settings: LossSettings, t2d: torch.Tensor | None
) -> LossOutput:
    """The metrics stay on the device (LossOutput.values), read once per step after the optimizer: a training
    step is launch-bound, and every read waits for the GPU (and, with other runs on it, for their turn).
    EAGLE-3's head scores every row, masked after, rather than selecting the scored rows (which reads their
    count back); EAGLE-1's head is the target's whole vocabulary, too large for every row, so it scores the
    selected rows."""
    eagle3 = isinstance(drafter, Eagle3Drafter)
    assert drafter.target is not None and (t2d is not None or not eagle3)
    steps = eagle_unroll(drafter, view.ids, view.features, settings.ttt_steps)
    total = view.ids.new_zeros((), dtype=torch.float32)
    values: dict[str, torch.Tensor] = {}
    leading: torch.Tensor | None = None  # per row: all steps so far correct
    accepted = torch.zeros_like(view.valid, dtype=torch.float32)
    for j, step in enumerate(steps):
        labels, valid = shifted(view.labels, 1 + j), shifted(view.valid, 1 + j, fill=False)
        if eagle3:
            assert t2d is not None
            labels = t2d[labels]
            valid = valid & (labels >= 0)
            logits = drafter.lm_head(step.head)
            log_q, scored_rows = logits.float().log_softmax(-1), valid.sum().clamp(min=1)
            ce = -(log_q.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * valid).sum() / scored_rows
            correct = (logits.argmax(-1) == labels) & valid
            loss = ce
            if settings.distill > 0:  # the same log-probabilities against the target's distribution
                assert view.soft is not None, "distillation needs target_view's soft_ids"
                soft_ce = -((shifted(view.soft, 1 + j).float() * log_q).sum(-1) * valid).sum() / scored_rows
                loss = (1 - settings.distill) * ce + settings.distill * soft_ce
                values[f"soft_ce_{j}"] = soft_ce.detach()
        else:
            logits = drafter.target.lm_head(step.head[valid])
            ce = F.cross_entropy(logits.float(), labels[valid]) if logits.shape[0] else total * 0
            target = shifted(view.hidden, 1 + j)[valid].float()
            feature = F.smooth_l1_loss(step.feedback[valid].float(), target) if target.shape[0] else total * 0
            loss = settings.token_weight * ce + settings.feature_weight * feature
            values[f"feature_loss_{j}"] = feature.detach()
            correct = torch.zeros_like(valid)
            correct[valid] = logits.argmax(-1) == labels[valid]
        total = total + settings.step_decay**j * loss
        values[f"ce_{j}"] = ce.detach()
        values[f"acc_{j}"] = (correct & valid).sum() / valid.sum().clamp(min=1)
        leading = correct if leading is None else leading & correct
        accepted += leading.float()
    scored = view.valid  # rows whose first prediction counts
    values["accept_length"] = 1 + (accepted * scored).sum() / scored.sum().clamp(min=1)
    values["loss"] = total.detach()
    return LossOutput(total, values)


def read_metrics(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalars on the device, read back in one copy."""
    numbers = torch.stack([v.float().reshape(()) for v in values.values()]).tolist()
    return dict(zip(values, numbers, strict=True))


def sample_anchors(view: TargetView, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row among positions a >= 1 whose next token is a response token
    ([B, count] anchors and whether each is real); drawn from `generator` on the CPU (device-independent)."""
    eligible = view.valid.clone()
    eligible[:, 0] = False
    scores = torch.rand(eligible.shape, generator=generator).to(eligible.device)
    scores = scores.masked_fill(~eligible, 2.0)
    count = min(count, eligible.shape[1])
    anchors = scores.topk(count, dim=1, largest=False).indices
    real = eligible.gather(1, anchors)
    return anchors.masked_fill(~real, 1), real


def dflash_loss(
    drafter: DFlashDrafter, view: TargetView, settings: LossSettings, generator: torch.Generator
) -> LossOutput:
    """Only the scored rows go through the target's LM head (all rows of the whole vocabulary would not fit),
    and their fp32 log-softmax is built once, for the cross-entropy and the distillation alike."""
    assert drafter.target is not None
    size = drafter.config.block_size
    anchors, real = sample_anchors(view, settings.num_anchors, generator)
    hidden = dflash_blocks(drafter, view.ids, view.features, anchors)[:, :, 1:]  # slot i predicts token a + i
    label_positions = anchors[..., None] + torch.arange(size - 1, device=anchors.device)  # [B, A, B-1]
    within = label_positions < view.ids.shape[1]
    label_positions = label_positions.clamp(max=view.ids.shape[1] - 1)
    flat = label_positions.flatten(1)
    labels = view.labels.gather(1, flat).view_as(label_positions)
    valid = view.valid.gather(1, flat).view_as(label_positions) & within & real[..., None]
    weights = torch.exp(-torch.arange(size - 1, device=anchors.device, dtype=torch.float32) / settings.gamma)
    logits = drafter.target.lm_head(hidden[valid])
    predicted, log_q = logits.argmax(-1), logits.float().log_softmax(-1)  # [N], [N, V]
    del logits  # only log_q ([N, V] fp32, kept for the backward) stays: no fp32 logits beside it
    # One gather for the label and the teacher's ids: its backward builds one [N, V] gradient, not one per part.
    picked_ids, teacher_probs = labels[valid][:, None], None
    if settings.distill > 0:
        assert view.teacher_ids is not None and view.teacher_probs is not None, "distillation needs teacher_k"
        rows = torch.arange(label_positions.shape[0], device=anchors.device)[:, None, None]
        teacher_ids = view.teacher_ids[rows, label_positions][valid]  # [N, K], at the labels' positions
        teacher_probs = view.teacher_probs[rows, label_positions][valid].float()
        picked_ids = torch.cat([picked_ids, teacher_ids.long()], dim=-1)
    picked = log_q.gather(-1, picked_ids)
    per_token = -picked[:, 0]  # what F.cross_entropy computes
    values = {"ce": per_token.detach().sum() / max(per_token.numel(), 1)}
    if teacher_probs is not None:
        soft_ce = -(teacher_probs * picked[:, 1:]).sum(-1)
        values["soft_ce"] = soft_ce.detach().sum() / max(soft_ce.numel(), 1)
        per_token = (1 - settings.distill) * per_token + settings.distill * soft_ce
    row_weights = weights.expand_as(valid)[valid]
    loss = (per_token * row_weights).sum() / row_weights.sum().clamp(min=1e-6)
    correct = torch.zeros_like(valid)
    correct[valid] = predicted == labels[valid]
    values = {"loss": loss.detach(), **values}
    for slot in range(size - 1):
        here = valid[..., slot]
        values[f"acc_{slot}"] = (correct[..., slot] & here).sum() / here.sum().clamp(min=1)
    scored = valid[..., 0]
    leading = correct.int().cumprod(dim=-1).sum(dim=-1).float()
    values["accept_length"] = 1 + (leading * scored).sum() / scored.sum().clamp(min=1)
    return LossOutput(loss, values)

"""The EAGLE losses score every row and read their metrics back once; they must equal the plain formulation
that selects the scored rows first (cross-entropy over those rows, accuracy and accept length over them)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from executor_builders import tiny_model
from random_text import tiny_target_and_text

from executor_service.models.draft_models import Eagle3Drafter
from executor_service.models.model import DecoderModel
from specdec_training.features import Sequence, collate, shifted, target_view
from specdec_training.init import trainable_drafter
from specdec_training.losses import LossSettings, eagle_loss
from specdec_training.recipes import RECIPES, draft_config, with_overrides
from specdec_training.unroll import eagle_unroll

CPU = torch.device("cpu")


def reference(drafter, view, settings: LossSettings, t2d) -> tuple[float, dict[str, float]]:
    """The loss and metrics with the scored rows selected before the head (one read per metric)."""
    eagle3 = t2d is not None
    total, metrics, leading = 0.0, {}, None
    accepted = torch.zeros_like(view.valid, dtype=torch.float32)
    for j, step in enumerate(eagle_unroll(drafter, view.ids, view.features, settings.ttt_steps)):
        labels, valid = shifted(view.labels, 1 + j), shifted(view.valid, 1 + j, fill=False)
        if eagle3:
            labels = t2d[labels]
            valid = valid & (labels >= 0)
        head = drafter.lm_head if eagle3 else drafter.target.lm_head
        logits = head(step.head[valid])
        ce = F.cross_entropy(logits, labels[valid]) if logits.shape[0] else torch.tensor(0.0)
        loss = ce
        if not eagle3:
            feature = F.smooth_l1_loss(step.feedback[valid], shifted(view.hidden, 1 + j)[valid])
            loss = settings.token_weight * ce + settings.feature_weight * feature
            metrics[f"feature_loss_{j}"] = feature.item()
        total += settings.step_decay**j * loss.item()
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == labels[valid]
        metrics[f"ce_{j}"] = ce.item()
        metrics[f"acc_{j}"] = float(correct[valid].float().mean()) if valid.any() else 0.0
        leading = correct if leading is None else leading & correct
        accepted += leading.float()
    metrics["accept_length"] = 1 + float(accepted[view.valid].mean())
    metrics["loss"] = total
    return total, metrics


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_losses_equal_the_selected_rows_formulation(method: str) -> None:
    torch.manual_seed(0)
    target = tiny_model().model
    rng = random.Random(0)
    vocab = target.config.vocab_size
    sequences = [
        Sequence([rng.randrange(vocab) for _ in range(rng.randint(2, 6))], [rng.randrange(vocab) for _ in range(n)])
        for n in (5, 12, 9)
    ]
    recipe = with_overrides(RECIPES[method], intermediate_size=96, draft_vocab_size=vocab // 2)
    drafter, t2d = trainable_drafter(draft_config(recipe, target.config), target, sequences, 0, CPU)
    view = target_view(target, drafter.config, collate(sequences, 64, CPU))
    settings = LossSettings(ttt_steps=3)
    out = eagle_loss(drafter, view, settings, t2d)
    expected_loss, expected = reference(drafter, view, settings, t2d)
    if method == "eagle3":  # half the vocabulary: some labels fall outside it and are not scored
        assert 0 < int((t2d[view.labels] < 0).sum()) < view.labels.numel()
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert out.metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def tiny_eagle3(
    seed: int, response_lengths: tuple[int, ...]
) -> tuple[DecoderModel, list[Sequence], Eagle3Drafter, torch.Tensor | None]:
    """The tiny target, sequences of a 3-token prompt and random responses of these lengths, and an EAGLE-3
    drafter over half its vocabulary (with its t2d)."""
    target, sequences = tiny_target_and_text(seed, response_lengths)
    vocab = target.config.vocab_size
    recipe = with_overrides(RECIPES["eagle3"], intermediate_size=96, draft_vocab_size=vocab // 2)
    drafter, t2d = trainable_drafter(draft_config(recipe, target.config), target, sequences, 0, CPU)
    assert isinstance(drafter, Eagle3Drafter)
    return target, sequences, drafter, t2d


def test_distillation_trains_towards_the_targets_distribution_over_the_draft_vocabulary() -> None:
    """--distill w: the loss is (1 - w) x the greedy cross-entropy + w x the cross-entropy against the target's
    distribution over the draft vocabulary (renormalized there); w = 0 leaves the greedy loss unchanged."""
    target, sequences, drafter, t2d = tiny_eagle3(seed=1, response_lengths=(7, 11))
    soft_ids = drafter.target_ids()
    batch = collate(sequences, 64, CPU)
    view = target_view(target, drafter.config, batch, soft_ids)
    logits = target.compute_logits(view.hidden.flatten(0, 1)).view(*view.ids.shape, -1)
    expected_soft = logits[..., soft_ids].softmax(-1)
    assert torch.allclose(view.soft.float(), expected_soft, atol=4e-3)  # bf16
    assert torch.allclose(view.soft.float().sum(-1), torch.ones(view.ids.shape), atol=2e-2)

    greedy = eagle_loss(drafter, view, LossSettings(ttt_steps=2), t2d)
    half = eagle_loss(drafter, view, LossSettings(ttt_steps=2, distill=0.5), t2d)
    steps = eagle_unroll(drafter, view.ids, view.features, 2)
    expected = 0.0
    for j, step in enumerate(steps):
        labels = t2d[shifted(view.labels, 1 + j)]
        valid = shifted(view.valid, 1 + j, fill=False) & (labels >= 0)
        log_q = drafter.lm_head(step.head).log_softmax(-1)
        soft_ce = -(shifted(view.soft, 1 + j).float() * log_q).sum(-1)[valid].mean()
        assert half.metrics[f"soft_ce_{j}"] == pytest.approx(soft_ce.item(), rel=1e-5)
        expected += 0.8**j * (0.5 * greedy.metrics[f"ce_{j}"] + 0.5 * soft_ce.item())
    assert half.loss.item() == pytest.approx(expected, rel=1e-5)
    assert "soft_ce_0" not in greedy.metrics
    assert half.loss.item() != pytest.approx(greedy.loss.item(), rel=1e-3)


@pytest.mark.parametrize(("argv", "message"), [
    (["--distill", "1.5"], "in \\[0, 1\\]"),
    (["--distill", "0.5", "--method", "eagle"], "--distill is for eagle3 and dflash, not eagle"),
])  # fmt: skip
def test_distill_is_checked(argv: list[str], message: str) -> None:
    from specdec_training.cli import build_parser, recipe_from

    base = ["--method", "eagle3", "--target", "synthetic:tiny", "--out", "x"]
    with pytest.raises(ValueError, match=message):
        recipe_from(build_parser().parse_args(base + argv))


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_distill_is_taken_by_eagle3_and_dflash(method: str) -> None:
    from specdec_training.cli import build_parser, recipe_from

    argv = ["--method", method, "--target", "synthetic:tiny", "--out", "x", "--distill", "0.5"]
    assert recipe_from(build_parser().parse_args(argv)).loss.distill == 0.5


def test_padding_to_a_width_multiple_changes_no_loss_or_metric() -> None:
    """Trainer pads a batch's width up to a multiple of PAD_MULTIPLE (fewer shapes for attention to plan):
    padding is never scored and real rows never attend to it, so every number must stay what it was."""
    target, sequences, drafter, t2d = tiny_eagle3(seed=2, response_lengths=(6, 10))
    soft_ids = drafter.target_ids()
    settings = LossSettings(ttt_steps=3, distill=0.5)
    outs = {}
    for multiple in (1, 8, 64):
        batch = collate(sequences, 24, CPU, pad_multiple=multiple)
        outs[multiple] = (batch.ids.shape[1], eagle_loss(drafter, target_view(target, drafter.config, batch, soft_ids),
                                                         settings, t2d))  # fmt: skip
    assert [width for width, _ in outs.values()] == [13, 16, 24]  # 13 tokens; 64 is capped at max_len
    for width, out in outs.values():
        assert out.loss.item() == pytest.approx(outs[1][1].loss.item(), rel=1e-5), width
        for name, value in outs[1][1].metrics.items():
            assert out.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (width, name)

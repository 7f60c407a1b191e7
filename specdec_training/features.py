"""What a drafter learns from: a batch of generated sequences and the target's view of them.

The features are exactly what the engine hands the drafter at inference (ModelRunner.forward): the
residual stream after each of the drafter's `target_layer_ids`, concatenated in that order, or for
EAGLE-1 the target's final normed hidden state. Labels are the target's own greedy choice at every
position (the token a verification accepts a draft against); only predictions of response tokens, the
text the target wrote itself, count in the losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.models.draft_config import DraftConfig, feature_layers
from executor_service.models.model import DecoderModel
from specdec_training.dense import target_forward

LABEL_CHUNK_ROWS = 4096  # rows of logits [rows, V] computed at once for the labels
# DFlash distills against the target's K most likely next tokens at every position, not its whole distribution:
# [B, L, V] over SmolLM2's 49,152 ids is 1.6 GB in bf16 for a batch of 16 x 1024 tokens, the top 64 (ids and
# probabilities) 12 MB. What it drops is the tail past the 64th token, which sampling at T = 0.7 draws from even
# less than the T = 1 distribution taught here; the kept probabilities are renormalized over the K ids.
TEACHER_TOP_K = 64


@dataclass(frozen=True)
class Sequence:
    """One training example: a rendered prompt and the target's response to it."""

    prompt: list[int]
    response: list[int]
    kind: str = ""

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.response


@dataclass
class Batch:
    ids: torch.Tensor  # [B, L] int64, right-padded with 0
    lengths: torch.Tensor  # [B] tokens of each row
    response_start: torch.Tensor  # [B] position of each row's first response token


def collate(sequences: list[Sequence], max_len: int, device: torch.device, pad_multiple: int = 1) -> Batch:
    """Right-pad to the longest row, rounded up to a multiple of `pad_multiple` (never past `max_len` for that):
    few distinct widths let attention reuse its plans (see Trainer). A sequence longer than `max_len` loses the
    start of its prompt first (a long conversation keeps its latest turns and the response), then the end of
    its response. Padding is never a response token, so it is never scored."""
    cuts = [min(len(s.prompt), max(0, len(s.ids) - max_len)) for s in sequences]
    rows = [s.ids[cut : cut + max_len] for s, cut in zip(sequences, cuts, strict=True)]
    longest = max(len(r) for r in rows)
    width = max(longest, min(-(-longest // pad_multiple) * pad_multiple, max_len))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows])
    starts = torch.tensor([len(s.prompt) - cut for s, cut in zip(sequences, cuts, strict=True)])
    return Batch(ids.to(device), lengths.to(device), starts.to(device))


@dataclass
class TargetView:
    ids: torch.Tensor  # [B, L]
    features: torch.Tensor  # [B, L, F] what the drafter reads at each position
    hidden: torch.Tensor  # [B, L, H] the target's final normed hidden state (EAGLE-1's regression target)
    labels: torch.Tensor  # [B, L] the target's greedy next token after each position
    valid: torch.Tensor  # [B, L] bool: the token after this position is a response token
    # [B, L, V'] bf16: the target's next-token distribution over `soft_ids` (renormalized over them), when asked
    soft: torch.Tensor | None = None
    # [B, L, K] int64 / fp32: the target's K most likely next tokens (most likely first) and their probabilities
    # at T = 1 renormalized over them, when asked (`teacher_k`)
    teacher_ids: torch.Tensor | None = None
    teacher_probs: torch.Tensor | None = None


@torch.no_grad()
def target_view(
    model: DecoderModel,
    config: DraftConfig,
    batch: Batch,
    soft_ids: torch.Tensor | None = None,
    teacher_k: int = 0,
) -> TargetView:
    """The features and labels; with `soft_ids` (EAGLE-3's draft vocabulary as target ids) also the target's
    distribution over them, which distillation trains the drafter's own head towards; with `teacher_k` the
    target's top-K distribution, which DFlash's distillation trains towards through the target's LM head. Both
    are computed chunk by chunk with the labels, so no [B, L, V] tensor is ever held."""
    hidden, aux = target_forward(model, batch.ids, feature_layers(config))
    features = torch.cat(aux, dim=-1) if aux else hidden
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels, soft, top_ids, top_probs = [], [], [], []
    for i in range(0, flat.shape[0], LABEL_CHUNK_ROWS):
        logits = model.compute_logits(flat[i : i + LABEL_CHUNK_ROWS])
        labels.append(logits.argmax(-1))
        if soft_ids is not None:
            soft.append(logits.index_select(-1, soft_ids).float().softmax(-1).to(torch.bfloat16))
        if teacher_k:  # a softmax over the kept logits: the full softmax's probabilities renormalized over them
            top = logits.topk(min(teacher_k, logits.shape[-1]), dim=-1)
            top_ids.append(top.indices)
            top_probs.append(top.values.float().softmax(-1))
    shape = batch.ids.shape
    following = torch.arange(batch.ids.shape[1], device=batch.ids.device)[None] + 1
    valid = (following >= batch.response_start[:, None]) & (following < batch.lengths[:, None])
    distribution = torch.cat(soft).view(*shape, -1) if soft else None
    teacher_ids = torch.cat(top_ids).view(*shape, -1) if top_ids else None
    teacher_probs = torch.cat(top_probs).view(*shape, -1) if top_probs else None
    labels_view = torch.cat(labels).view(shape)
    return TargetView(batch.ids, features, hidden, labels_view, valid, distribution, teacher_ids, teacher_probs)


def shifted(x: torch.Tensor, by: int, fill: float | bool | int = 0) -> torch.Tensor:
    """x[:, p + by] at row p (past the end: `fill`), along dim 1."""
    if by == 0:
        return x
    pad = torch.full((x.shape[0], min(by, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, by:], pad], dim=1)

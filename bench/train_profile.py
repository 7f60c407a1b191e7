"""Where a drafter's training step spends its time: the target's view, the drafter's loss, the backward pass
and the optimizer, timed apart (synchronized) over a few steps, then one profiled step's top kernels.

    python bench/train_profile.py --target PATH.gguf --init-from drafters/smollm2-eagle3 --method eagle3

The batch is random token ids of realistic lengths (a prompt of `--prompt-len` and a response of
`--response-len`): the step's cost depends on the shapes, not on what the tokens say.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import commit_id, device_tag, versions, write_result

from executor_service.training.cli import pick_device
from executor_service.training.features import Sequence
from executor_service.training.init import pretrained_config, pretrained_drafter, trainable_drafter
from executor_service.training.recipes import RECIPES, draft_config, with_overrides
from executor_service.training.target import load_target, target_source
from executor_service.training.trainer import Trainer


def random_sequences(vocab: int, count: int, prompt_len: int, response_len: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    return [
        Sequence([rng.randrange(vocab) for _ in range(prompt_len)], [rng.randrange(vocab) for _ in range(response_len)])
        for _ in range(count)
    ]


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
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    device = pick_device(args.device)
    recipe = with_overrides(RECIPES[args.method], batch_size=args.batch_size)
    loaded = load_target(target_source(args.target), torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    sequences = random_sequences(loaded.config.vocab_size, args.batch_size * (args.steps + 3), args.prompt_len,
                                 args.response_len, seed=0)  # fmt: skip
    config = draft_config(recipe, loaded.config, mask_token_id=0)
    if args.init_from:
        config = pretrained_config(args.init_from, config, loaded.config)
        drafter, t2d = pretrained_drafter(args.init_from, config, loaded.model, device)
    else:
        drafter, t2d = trainable_drafter(config, loaded.model, sequences, 0, device)
    trainer = Trainer(drafter, loaded.model, sequences, recipe, 0, device, t2d, progress=False)
    for _ in range(2):  # warm-up: allocator, autotuning
        timed_step(trainer)
    rows = [timed_step(trainer) for _ in range(args.steps)]
    medians = {name: round(1e3 * statistics.median(r[name] for r in rows), 2) for name in rows[0]}
    print("median ms per step:", medians)

    kernels: list[dict] = []
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            timed_step(trainer)
        events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
        kernels = [
            {"name": e.key[:100], "ms": round(e.device_time_total / 1e3, 3), "count": e.count} for e in events[:25]
        ]
        for row in kernels:
            print(f"{row['ms']:9.3f} ms {row['count']:6d}  {row['name']}")
    commit, dirty = commit_id()
    result = {"benchmark": "train_profile", "date": dt.date.today().isoformat(), "commit": commit, "dirty": dirty,
              "device": device_tag(device), "versions": versions(), "method": args.method,
              "batch_size": args.batch_size, "prompt_len": args.prompt_len, "response_len": args.response_len,
              "median_ms": medians, "top_kernels": kernels}  # fmt: skip
    write_result(args.out, f"train_profile_{args.method}", device, commit, result)


if __name__ == "__main__":
    main()

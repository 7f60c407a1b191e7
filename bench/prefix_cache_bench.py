"""Prefix caching: time to first token of requests that share a long system prompt, with and without caching.

Two sessions over the same synthetic target weights (Llama-3-8B's shape on the GPU) and the same drafter, one
with LoadModelRequest.enable_prefix_caching on, then one with it off. In each, one request with the system prompt
runs first (in serving the system prompt is hot), then --requests requests (the system prompt + their own
user tokens) arrive at once; time to first token is from the arrival to the moment the engine hands out the
request's first token. Repeats use new user tokens each; the figures are medians over the repeats, after one
untimed burst per session (kernels compile for new shapes). Reported: TTFT (median, p90, the last request's)
with and without, their ratio against the issue's bar (<= 0.3), the burst's prefix-cache hit rate, and
whether every request's tokens are identical with and without (greedy). When they are not, the controls of
prefix_cache_controls.py tell the caching logic from bf16 rounding: the same comparison with the arithmetic
pinned (requests one at a time, chunked at the cache boundary), the burst in fp32 without TF32, and the top-2
logit gap at each divergence.

    python bench/prefix_cache_bench.py --out bench/results      # H100: Llama-3-8B shape, bf16, EAGLE-3
    python bench/prefix_cache_bench.py --tiny --out /tmp        # a CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, log, median, provenance, versions, write_result  # noqa: E402
from prefix_cache_controls import (  # noqa: E402
    cache_boundary,
    flat,
    identity,
    near_ties,
    pinned_outputs,
    pinned_report,
    strict_fp32,
    verdict,
)
from specdec_bench import draft_request, target_request  # noqa: E402

from executor_service.engine.kv_cache import blocks_needed  # noqa: E402
from executor_service.engine.request import RequestOutput  # noqa: E402
from executor_service.models.loader import LoadedModel, build_synthetic  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.server.drafting import resolve_draft  # noqa: E402
from executor_service.server.session import EngineSettings, ModelSession, build_session  # noqa: E402
from executor_service.server.validation import DEFAULT_BLOCK_SIZE  # noqa: E402
from executor_service.server.wire import DTYPE_ENUMS, resolve_dtype, resolve_target  # noqa: E402
from specdec.v1 import common_pb2  # noqa: E402

TTFT_BAR = 0.3  # issue 17: TTFT with caching at most 0.3x of without
DEFAULTS = {
    "preset": "llama3-8b", "device": "cuda" if torch.cuda.is_available() else "cpu", "backend": "TRITON_ATTN",
    "method": "eagle3", "system_tokens": 2048, "user_tokens": 64, "requests": 64, "repeats": 3,
}  # fmt: skip
TINY = {
    "preset": "tiny", "device": "cpu", "backend": "CPU_ATTN", "method": "none", "system_tokens": 64, "user_tokens": 8,
    "requests": 4, "repeats": 2,
}  # fmt: skip
CONTROLS = ("pinned", "fp32", "ties")


def open_session(
    args: argparse.Namespace, loaded: LoadedModel, caching: bool, dtype: torch.dtype, kv_blocks: int
) -> ModelSession:
    """A session over `loaded`, built in `dtype`, with `kv_blocks` KV blocks."""
    preset = PRESETS[args.preset]
    request = target_request(preset, DTYPE_ENUMS[dtype], args.backend, kv_blocks)
    request.enable_prefix_caching = caching
    source = resolve_target(request.target, None, "target")
    draft = None
    if args.method != "none":
        request.draft.CopyFrom(draft_request(args.method, preset))
        draft = resolve_draft(request.draft, source.config, None)
    decision = common_pb2.BackendDecision(backend=args.backend)
    settings = EngineSettings(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.requests + 1)
    started = time.perf_counter()
    session = build_session(
        source, request, decision, torch.device(args.device), settings, start=False, draft=draft,
        draft_decision=decision if draft is not None else None, preloaded=loaded,
    )  # fmt: skip
    log(f"session caching={caching}: {time.perf_counter() - started:.1f} s (load, warm-up, graphs)")
    return session


def burst(session: ModelSession, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """All prompts arrive at once; each one's seconds to its first token, and its tokens."""
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    first: dict[int, float] = {}
    tokens: list[list[int]] = [[] for _ in prompts]

    def sink_of(index: int) -> Any:
        def sink(output: RequestOutput) -> None:
            if output.error is not None:
                raise RuntimeError(f"request {index} failed: {output.error}")
            if output.token_ids and index not in first:
                first[index] = time.perf_counter()
            tokens[index].extend(output.token_ids)

        return sink

    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        session.engine.add(session.new_request(f"b{index}", prompt, settings, max_tokens, sink_of(index)))
    session.engine.run_until_idle()
    return [first[i] - started for i in range(len(prompts))], tokens


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def measure(session: ModelSession, system: list[int], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The warm-up request, one untimed burst, then the timed repeats (user tokens seeded by repeat)."""
    burst(session, [[*system, 1]], args.max_tokens)
    burst(session, user_prompts(system, args, vocab, seed=10_000), args.max_tokens)
    runs, outputs = [], []
    for repeat in range(args.repeats):
        before = session.prefix_cache_stats()
        ttft, tokens = burst(session, user_prompts(system, args, vocab, seed=repeat), args.max_tokens)
        after = session.prefix_cache_stats()
        queries, hits = after.queries - before.queries, after.hits - before.hits
        runs.append({
            "ttft_median_ms": round(median(ttft) * 1e3, 3),
            "ttft_p90_ms": round(percentile(ttft, 0.9) * 1e3, 3),
            "ttft_last_ms": round(max(ttft) * 1e3, 3),
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        })  # fmt: skip
        outputs.append(tokens)
        log(f"caching={session.info.prefix_caching} repeat {repeat}: {runs[-1]}")
    summary = {key: median([run[key] for run in runs]) for key in ("ttft_median_ms", "ttft_p90_ms", "ttft_last_ms")}
    return {"summary": summary, "runs": runs, "outputs": outputs}


def user_prompts(system: list[int], args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[*system, *(rng.randrange(1, vocab) for _ in range(args.user_tokens))] for _ in range(args.requests)]


def parse_args() -> argparse.Namespace:
    """Flags left out take the GPU run's defaults, or with --tiny the CPU smoke run's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=f"CPU smoke run, defaults {TINY}")
    parser.add_argument("--preset", choices=sorted(PRESETS), help=f"default {DEFAULTS['preset']}")
    parser.add_argument("--device", help="default: cuda if there is one")
    parser.add_argument("--backend", help=f"default {DEFAULTS['backend']}")
    parser.add_argument("--method", choices=["none", "eagle", "eagle3", "dflash"], help=f"default {DEFAULTS['method']}")
    parser.add_argument(
        "--system-tokens", type=int, help=f"the shared system prompt (default {DEFAULTS['system_tokens']})"
    )
    parser.add_argument(
        "--user-tokens", type=int, help=f"each request's own after it (default {DEFAULTS['user_tokens']})"
    )
    parser.add_argument("--requests", type=int, help=f"arriving at once (default {DEFAULTS['requests']})")
    parser.add_argument("--repeats", type=int, help=f"timed bursts per session (default {DEFAULTS['repeats']})")
    parser.add_argument("--max-tokens", type=int, default=8, help="default 8")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="default 8192")
    parser.add_argument("--kv-blocks", type=int, default=0, help="per session (default 0: every request's tokens fit)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on a GPU, else float32")
    parser.add_argument(
        "--controls", default=",".join(CONTROLS), help=f"of {','.join(CONTROLS)}, or none (default all)"
    )
    parser.add_argument("--fp32-requests", type=int, help="the fp32 control's burst (default 16, --tiny 4)")
    parser.add_argument("--max-probes", type=int, default=64, help="divergences probed for near ties (default 64)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.controls = [] if args.controls == "none" else args.controls.split(",")
    if unknown := set(args.controls) - set(CONTROLS):
        parser.error(f"--controls: unknown {sorted(unknown)}")
    args.dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else resolve_dtype(common_pb2.DTYPE_UNSPECIFIED, torch.device(args.device))
    )
    args.fp32_requests = args.fp32_requests or min(args.requests, 4 if args.tiny else 16)
    args.kv_blocks = args.kv_blocks or kv_blocks_for(args, args.requests)
    return args


def kv_blocks_for(args: argparse.Namespace, requests: int) -> int:
    """Blocks for the warm request and `requests` at once (drafts and lookahead included)."""
    per_request = args.system_tokens + args.user_tokens + args.max_tokens + 2 * 16
    return blocks_needed((requests + 1) * per_request, DEFAULT_BLOCK_SIZE) + 16


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """With against without: the TTFT ratio and its bar, the hit rate, and identical outputs (greedy)."""
    ratio = on["summary"]["ttft_median_ms"] / off["summary"]["ttft_median_ms"]
    return {
        "without_caching": {"summary": off["summary"], "runs": off["runs"]},
        "with_caching": {"summary": on["summary"], "runs": on["runs"]},
        "ttft_ratio": round(ratio, 4),
        "ttft_bar": TTFT_BAR,
        "ttft_bar_met": ratio <= TTFT_BAR,
        "prefix_cache_hit_rate": median([run["prefix_cache_hit_rate"] for run in on["runs"]]),
        **identity(flat(off["outputs"]), flat(on["outputs"])),
    }


def close(session: ModelSession) -> None:
    session.shutdown()
    del session
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def burst_and_pinned(args: argparse.Namespace, config: Any, system: list[int], vocab: int) -> dict[str, Any]:
    """The timed bursts with and without caching and, in the same sessions, the pinned control. The session
    without caching goes second and probes every divergence for a near tie: its prefills read nothing cached.
    Returns the report's part of it."""
    loaded = build_synthetic(config, 0, args.dtype, torch.device(args.device))
    prompts = [user_prompts(system, args, vocab, seed=repeat) for repeat in range(args.repeats)]
    boundary = cache_boundary(args.system_tokens, args.method, DEFAULT_BLOCK_SIZE)
    results, pinned = {}, {}
    for caching in (True, False):  # one session at a time: each holds its own KV cache
        session = open_session(args, loaded, caching, args.dtype, args.kv_blocks)
        results[caching] = measure(session, system, args, vocab)
        if "pinned" in args.controls:
            pinned[caching] = pinned_outputs(session, system, prompts[0], args.max_tokens, boundary)
            pinned[caching, "logprobs"] = pinned_outputs(session, system, prompts[0], args.max_tokens, boundary, 1)
            log(f"pinned control caching={caching}: {sum(pinned[caching]['cached'])} prompt tokens found cached")
        if not caching:
            report = compare(results[True], results[False])
            if "pinned" in args.controls:
                report["pinned"] = pinned_report(pinned, boundary)
            if "ties" in args.controls:
                off = flat(results[False]["outputs"])
                report["near_ties"] = near_ties(session, flat(prompts), off, report["divergences"], args.max_probes)
                if "pinned" in args.controls and report["pinned"]["divergences"]:
                    found, off = report["pinned"]["divergences"], pinned[False]["outputs"]
                    report["pinned"]["near_ties"] = near_ties(session, prompts[0], off, found, args.max_probes)
        close(session)
    return report


def fp32_control(args: argparse.Namespace, config: Any, system: list[int], vocab: int) -> dict[str, Any]:
    """The burst's comparison (its schedule, fewer requests) in float32 with TF32 off."""
    gc.collect()  # the bf16 sessions and weights
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.cuda.is_available():
        log(f"fp32 control: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated before its weights")
    precision = strict_fp32()
    loaded = build_synthetic(config, 0, torch.float32, torch.device(args.device))
    prompts = user_prompts(system, args, vocab, seed=0)[: args.fp32_requests]
    outputs, hits = {}, 0
    for caching in (True, False):  # as the burst's: the session without caching probes
        session = open_session(args, loaded, caching, torch.float32, kv_blocks_for(args, len(prompts)))
        burst(session, [[*system, 1]], args.max_tokens)
        outputs[caching] = burst(session, prompts, args.max_tokens)[1]
        if caching:
            hits = session.prefix_cache_stats().hits
        else:
            report = {"requests": len(prompts), **precision, **identity(outputs[False], outputs[True])}
            report["prefix_cache_hits"] = hits
            if "ties" in args.controls and report["divergences"]:
                found = report["divergences"]
                report["near_ties"] = near_ties(session, prompts, outputs[False], found, args.max_probes)
        close(session)
    log(f"fp32 control: identical {report['identical_requests']}")
    return report


def main() -> int:
    args = parse_args()
    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    vocab = preset["vocab"] - 1  # DFlash's mask token is the last id
    system = [random.Random(-1).randrange(1, vocab) for _ in range(args.system_tokens)]
    request = target_request(preset, 0, args.backend, args.kv_blocks)
    config = resolve_target(request.target, None, "target").config
    comparison = burst_and_pinned(args, config, system, vocab)
    if "fp32" in args.controls:  # after the bf16 weights are gone: 8B in fp32 needs the room
        try:
            comparison["fp32"] = fp32_control(args, config, system, vocab)
        except Exception as err:  # a control that cannot run (memory, dtype) must not lose the burst's figures
            log(f"fp32 control failed: {err!r}")
            comparison["fp32"] = {"error": repr(err)[:500]}
    workload = (
        "system_tokens",
        "user_tokens",
        "requests",
        "max_tokens",
        "repeats",
        "kv_blocks",
        "max_num_batched_tokens",
    )
    report: dict[str, Any] = {
        **provenance("prefix_cache", device),
        "versions": versions(),
        "preset": args.preset,
        "backend": args.backend,
        "method": args.method,
        "dtype": str(args.dtype).removeprefix("torch."),
        "workload": {key: getattr(args, key) for key in workload},
        **comparison,
    }
    report["identity_verdict"] = verdict(report)
    with_ms, without_ms = (report[key]["summary"]["ttft_median_ms"] for key in ("with_caching", "without_caching"))
    log(f"TTFT median {with_ms} ms with caching, {without_ms} ms without: {report['ttft_ratio']}x (bar {TTFT_BAR}); "
        f"hit rate {report['prefix_cache_hit_rate']}; identical {report['identical_requests']}")  # fmt: skip
    for name in ("pinned", "fp32"):
        if name in report:
            log(f"{name} control: identical {report[name].get('identical_requests', report[name])}")
    if "near_ties" in report:
        log(f"near ties at the burst's divergences: {report['near_ties']}")
    log(f"identity: {report['identity_verdict']}")
    write_result(args.out, "prefix_cache", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load bench (CPU; not a test): N concurrent Generate streams against a real executor process.

The executor runs as its own process on the CPU (`python -m executor_service.server.main --device cpu`) with a tiny
synthetic target and a synthetic drafter (EAGLE-3 k=3 by default); an asyncio client opens --streams Generate
streams at once over a few channels, greedy, each with --max-tokens (ignore_eos; every --stop-every-th stream
also gets stop tokens, every 16th id). Reported:

  streams     how many completed, failed (by status) and got exactly max_tokens tokens (or stopped at their stop
              token); a stream that got any other count is listed
  latency     per stream, from the call to its last message (p50 / p99 / max) and to its first token
  throughput  generated tokens / wall time of the whole burst
  memory      the executor's RSS after loading and a warm-up stream, after the burst, and its peak
  gauges      specdec_running_requests, specdec_queue_depth, specdec_kv_blocks_used once the streams are done
              (all must read 0), and the acceptance statistics the executor exports

Writes bench/results/load_<N>_<UTC date>_cpu_<commit>.json; exits 1 when a check fails (a stream failed or got
the wrong count, or a gauge is not back to 0).

    .venv/bin/python bench/load_bench.py --streams 256
    .venv/bin/python bench/load_bench.py --streams 1000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import grpc  # noqa: E402
import torch  # noqa: E402
from common import commit_id, log, versions, write_result  # noqa: E402
from executor_builders import TINY as TINY_TARGET  # noqa: E402  (the CPU tests' tiny target: serving, not the model)
from server_processes import ServerProcess, spawn_server  # noqa: E402
from spec_builders import draft_model  # noqa: E402

from executor_service.engine.kv_cache import blocks_needed  # noqa: E402
from executor_service.models.draft_config import METHOD_ENUMS  # noqa: E402
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc  # noqa: E402

BLOCK_SIZE = 16
METHODS = ("none", *METHOD_ENUMS)  # no drafter, or a synthetic one of each method
GAUGES = ("specdec_running_requests", "specdec_queue_depth", "specdec_kv_blocks_used")
COUNTERS = tuple(
    f"{name}_total"
    for name in ("specdec_generated_tokens", "specdec_draft_tokens", "specdec_accepted_tokens", "specdec_verify_steps")
)
CONFIG_KEYS = ("streams", "max_tokens", "prompt_len", "method", "k", "stop_every", "channels", "max_num_seqs")
# Every 16th id: a random-weight target emits one within a few dozen tokens, so stop streams really stop.
STOP_TOKENS = frozenset(range(0, TINY_TARGET["vocab_size"], 16))


@dataclass
class StreamResult:
    index: int
    max_tokens: int
    stops: frozenset[int]  # empty: runs to max_tokens
    started: float = 0.0
    first_token: float | None = None
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    code: str = "OK"
    details: str = ""

    def exact(self) -> bool:
        """Exactly max_tokens tokens and none of its stops, or fewer ending at its first stop token ("stop")."""
        if self.code != "OK":
            return False
        if self.finish_reason == "length":
            return len(self.tokens) == self.max_tokens and not self.stops.intersection(self.tokens)
        stopped = self.finish_reason == "stop" and self.tokens and self.tokens[-1] in self.stops
        return bool(stopped) and not self.stops.intersection(self.tokens[:-1]) and len(self.tokens) <= self.max_tokens


def load_request(args: argparse.Namespace) -> executor_pb2.LoadModelRequest:
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(synthetic=executor_pb2.SyntheticModel(architecture="llama", **TINY_TARGET)),
        dtype=common_pb2.DTYPE_FLOAT32,
        block_size=BLOCK_SIZE,
        num_kv_blocks=args.num_kv_blocks or kv_blocks_for(args),
    )
    if args.method != "none":
        request.draft.CopyFrom(draft_model(args.method, args.k, vocab_size=TINY_TARGET["vocab_size"]))
    return request


def kv_blocks_for(args: argparse.Namespace) -> int:
    """Pages for a full running batch (prompt, max_tokens and a speculative step's drafts and lookahead each),
    plus 10%: the bench measures serving under load, not preemption."""
    per_request = blocks_needed(args.prompt_len + args.max_tokens + 2 * (args.k + 1) + BLOCK_SIZE, BLOCK_SIZE)
    return int(min(args.streams, args.max_num_seqs) * per_request * 1.1) + 8


def prompt(index: int, length: int) -> list[int]:
    """A different prompt per stream."""
    ids = [(index * 31 + 11 * i) % TINY_TARGET["vocab_size"] for i in range(length)]
    return ids


async def run_stream(stub: executor_pb2_grpc.ExecutorStub, result: StreamResult, args: argparse.Namespace) -> None:
    params = executor_pb2.SamplingParams(max_tokens=result.max_tokens, ignore_eos=True)
    params.stop_token_ids.extend(sorted(result.stops))
    request = executor_pb2.GenerateRequest(
        request_id=f"load-{result.index}",
        token_ids=executor_pb2.TokenIds(ids=prompt(result.index, args.prompt_len)),
        sampling=params,
    )
    result.started = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=args.timeout):
            if response.token_ids and result.first_token is None:
                result.first_token = time.perf_counter()
            result.tokens.extend(response.token_ids)
            if response.HasField("finished"):
                result.finish_reason = response.finished.finish_reason
    except grpc.aio.AioRpcError as err:
        result.code, result.details = err.code().name, (err.details() or "")[:200]
    result.ended = time.perf_counter()


async def burst(address: str, args: argparse.Namespace) -> tuple[list[StreamResult], float]:
    """All streams at once over --channels channels; returns the results and the wall time."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(args.channels)]
    stubs = [executor_pb2_grpc.ExecutorStub(channel) for channel in channels]
    results = [
        StreamResult(i, args.max_tokens, STOP_TOKENS if args.stop_every and i % args.stop_every == 0 else frozenset())
        for i in range(args.streams)
    ]
    started = time.perf_counter()
    await asyncio.gather(*(run_stream(stubs[r.index % len(stubs)], r, args) for r in results))
    wall = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    return results, wall


async def load_and_warm_up(address: str, args: argparse.Namespace) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        loaded = await stub.LoadModel(load_request(args), timeout=args.timeout)
        warm = StreamResult(-1, args.max_tokens, frozenset())
        await run_stream(stub, warm, args)
        if not warm.exact():
            raise RuntimeError(f"the warm-up stream failed: {warm}")
        info = loaded.info
        return {
            "target": {k: getattr(info, k) for k in ("vocab_size", "hidden_size", "num_layers", "max_model_len")},
            "method": common_pb2.SpecMethod.Name(info.spec_method),
            "k": info.num_speculative_tokens,
            "kv_blocks": info.num_kv_blocks,
            "block_size": info.block_size,
            "target_backend": loaded.target_backend.backend,
            "draft_backend": loaded.draft_backend.backend,
        }


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise KeyError(key)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process so far: with the wall time it tells contention (other processes on
    the cores) from work."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in text.splitlines() if line and line[0] != "#")
        if "{" not in name
    }


def gauges_after(port: int, settle_s: float) -> dict[str, float]:
    """The engine gauges once every stream has ended (they settle within a step or two)."""
    deadline = time.monotonic() + settle_s
    while True:
        samples = scrape(port)
        found = {name: samples[name] for name in (*GAUGES, *COUNTERS, "specdec_mean_acceptance_length")}
        if all(found[g] == 0 for g in GAUGES) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) in ms."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return round(ordered[rank - 1] * 1e3, 1)


def summarize(results: list[StreamResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.code == "OK"]
    latency = [r.ended - r.started for r in ok]
    first = [r.first_token - r.started for r in ok if r.first_token is not None]
    tokens = sum(len(r.tokens) for r in results)
    inexact = [r for r in results if not r.exact()]
    return {
        "streams": len(results),
        "completed": len(ok),
        "failed": dict(Counter(r.code for r in results if r.code != "OK")),
        "exact_token_counts": len(results) - len(inexact),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "with_stop_tokens": sum(bool(r.stops) for r in results),
        "inexact": [
            {"index": r.index, "code": r.code, "details": r.details, "tokens": len(r.tokens), "finish": r.finish_reason}
            for r in inexact[:20]
        ],
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "latency_ms": {"p50": percentile(latency, 50), "p99": percentile(latency, 99), "max": percentile(latency, 100)},
        "first_token_ms": {"p50": percentile(first, 50), "p99": percentile(first, 99), "max": percentile(first, 100)},
        "mean_latency_ms": round(statistics.fmean(latency) * 1e3, 1) if latency else None,
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256, help="concurrent Generate streams")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each stream asks for")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per stream")
    parser.add_argument("--method", choices=METHODS, default="eagle3", help="the synthetic drafter (none: no drafter)")
    parser.add_argument("--k", type=int, default=3, help="drafts per step")
    parser.add_argument("--stop-every", type=int, default=8, help="every Nth stream also has stop tokens (0: none)")
    parser.add_argument("--channels", type=int, default=8, help="client channels the streams are spread over")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the executor's running batch")
    parser.add_argument("--num-kv-blocks", type=int, default=0, help="0: a full running batch's needs + 10%%")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of every call (s)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="directory of the result file")
    args = parser.parse_args()
    if args.method == "none":
        args.k = 0
    return args


def main() -> int:
    args = parse_args()
    commit, dirty = commit_id()
    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp:
        server = spawn_server(
            "executor", "executor", Path(tmp), "--device", "cpu", "--metrics-port", "0",
            "--max-num-seqs", str(args.max_num_seqs), "--max-live-requests", str(max(4096, args.streams)),
        )  # fmt: skip
        try:
            return measure(server, args, commit, dirty)
        finally:
            status = server.stop()
            log(f"executor exit status {status}")


def measure(server: ServerProcess, args: argparse.Namespace, commit: str, dirty: bool | None) -> int:
    pid, metrics_port = server.process.pid, server.metrics_port()
    assert metrics_port is not None, server.log()
    model = asyncio.run(load_and_warm_up(server.address, args))
    rss_before, cpu_before, loadavg_before = rss_mib(pid), cpu_seconds(pid), os.getloadavg()
    log(f"loaded {model}; executor RSS {rss_before} MiB; {args.streams} streams of {args.max_tokens} tokens")
    results, wall = asyncio.run(burst(server.address, args))
    executor_cpu_s = cpu_seconds(pid) - cpu_before
    gauges = gauges_after(metrics_port, settle_s=10.0)
    rss_after = rss_mib(pid)
    summary = summarize(results, wall)
    checks = {
        "all_completed": summary["completed"] == args.streams,
        "exact_token_counts": summary["exact_token_counts"] == args.streams,
        "gauges_zero": all(gauges[g] == 0 for g in GAUGES),
    }
    report: dict[str, Any] = {
        "benchmark": "load",
        "utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "tracked_files_modified": dirty,
        "device": cpu_name(),
        "device_type": "cpu",
        "cpus": os.cpu_count(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "versions": versions(),
        "config": {key: getattr(args, key) for key in CONFIG_KEYS},
        "model": model,
        **summary,
        "executor_rss_mib": {"before": rss_before, "after": rss_after, "peak": rss_mib(pid, "VmHWM")},
        "executor_cpu_s": round(executor_cpu_s, 2),  # over the burst; compare with wall_s x cpus
        "metrics_after": gauges,
        "checks": checks,
        "ok": all(checks.values()),
    }
    log(
        f"{summary['completed']}/{args.streams} completed, {summary['exact_token_counts']} exact, "
        f"{summary['tokens_per_s']} tokens/s ({summary['wall_s']} s, executor CPU {executor_cpu_s:.1f} s), "
        f"latency p50 {summary['latency_ms']['p50']} ms "
        f"p99 {summary['latency_ms']['p99']} ms, first token p50 {summary['first_token_ms']['p50']} ms "
        f"p99 {summary['first_token_ms']['p99']} ms; RSS {rss_before} -> {rss_after} MiB; gauges "
        f"{ {g: gauges[g] for g in GAUGES} }; checks {checks}"
    )
    write_result(Path(args.out), f"load_{args.streams}", torch.device("cpu"), commit, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Selector benchmark (not a test): in-process selection latency, and SelectBackends throughput over gRPC on
loopback against a trivial echo RPC served by the same server. Writes bench/results/selector_<UTC date>_<commit>.json
and bench/results/selector_latest.json, and prints a summary.

    .venv/bin/python bench/selector_bench.py            # full run
    .venv/bin/python bench/selector_bench.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from selection.selector import Selector, select_backends
from selector_service.servicer import SERVICE_NAME, BackendSelectorServicer
from specdec.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings, create_server, start_server

REPO = Path(__file__).resolve().parent.parent
SELECT_METHOD = f"/{SERVICE_NAME}/SelectBackends"
ECHO_SERVICE = "specdec.bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"
BARS = {
    "in_process_cached_p50_us_max": 20.0,
    "in_process_uncached_p50_us_max": 200.0,
    "grpc_select_over_echo_throughput_min": 0.9,
}
Request = selector_pb2.SelectBackendsRequest

# ---------------------------------------------------------------- realistic requests


def _hardware(platform_: int, name: str, libs: dict[str, str], cc: tuple[int, int] = (0, 0), arch: str = "") -> Any:
    return common_pb2.HardwareCapabilities(
        platform=platform_,
        device_name=name,
        compute_capability_major=cc[0],
        compute_capability_minor=cc[1],
        gcn_arch=arch,
        total_memory_bytes=80 << 30,
        device_count=8,
        libraries=[common_pb2.KernelLibrary(name=n, version=v) for n, v in libs.items()],
    )


def build_requests() -> dict[str, Request]:
    cuda_libs = {"flash_attn": "4.0.0b36", "flashinfer": "0.5.3", "triton": "3.6.0", "torch": "2.11.0"}
    h100 = _hardware(common_pb2.PLATFORM_CUDA, "NVIDIA H100 80GB HBM3", cuda_libs, cc=(9, 0))
    b200 = _hardware(common_pb2.PLATFORM_CUDA, "NVIDIA B200", cuda_libs, cc=(10, 0))
    rocm_libs = {"triton": "3.6.0", "torch": "2.11.0", "aiter": "0.1.5"}
    mi300x = _hardware(common_pb2.PLATFORM_ROCM, "AMD Instinct MI300X", rocm_libs, arch="gfx942:sramecc+:xnack-")
    cpu = _hardware(common_pb2.PLATFORM_CPU, "x86_64", {"torch": "2.11.0"})
    # Llama-3-8B-like target; DFlash drafter with its own (smaller) shape.
    target = common_pb2.LayerSpec(
        head_size=128,
        num_heads=32,
        num_kv_heads=8,
        dtype=common_pb2.DTYPE_BFLOAT16,
        kv_cache_dtype="auto",
        block_size=16,
    )
    draft = common_pb2.LayerSpec(head_size=128, num_heads=32, num_kv_heads=8, dtype=common_pb2.DTYPE_BFLOAT16)

    def dflash(causal: bool) -> common_pb2.SpeculativeConfig:
        return common_pb2.SpeculativeConfig(
            method=common_pb2.SPEC_METHOD_DFLASH,
            num_speculative_tokens=15,
            draft_layers=draft,
            dflash_config=common_pb2.DFlashConfig(
                causal=causal, target_layer_ids=[1, 9, 17, 25, 31], mask_token_id=128002, block_size=16
            ),
        )

    eagle3 = common_pb2.SpeculativeConfig(method=common_pb2.SPEC_METHOD_EAGLE3, num_speculative_tokens=3)
    return {
        "cuda_sm90_target_only": Request(hardware=h100, target_layers=target),
        "cuda_sm90_dflash": Request(hardware=h100, target_layers=target, speculative=dflash(causal=False)),
        "rocm_gfx942_eagle3": Request(hardware=mi300x, target_layers=target, speculative=eagle3),
        "cpu_target_only": Request(hardware=cpu, target_layers=target),
        "cuda_sm100_causal_dflash": Request(hardware=b200, target_layers=target, speculative=dflash(causal=True)),
    }


# ---------------------------------------------------------------- statistics


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return float(sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)])


def latency_stats_us(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {
        "n": len(s),
        **{f"p{q}_us": round(percentile(s, q) / 1e3, 2) for q in (50, 90, 99)},
        "mean_us": round(statistics.fmean(s) / 1e3, 2),
    }


def time_calls(fn: Callable[[Request], object], requests: list[Request], n: int) -> list[int]:
    """Per-call latency in ns; call i gets requests[i % len(requests)]."""
    clock, out, k = time.perf_counter_ns, [], len(requests)
    gc.collect()
    for i in range(n):
        req = requests[i % k]
        t0 = clock()
        fn(req)
        out.append(clock() - t0)
    return out


def bench_in_process(n_cached: int, n_uncached: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, req in build_requests().items():
        selector = Selector()
        expected = selector.select(req)  # fills the cache; raises if the request is refused
        # A cache miss on every call: total_memory_bytes is ignored by selection, so each variant is a new key
        # with the same answer.
        variants = [Request() for _ in range(n_uncached)]
        for i, v in enumerate(variants):
            v.CopyFrom(req)
            v.hardware.total_memory_bytes += i + 1
        assert Selector().select(variants[-1]) == expected and select_backends(req) == expected
        cached = latency_stats_us(time_calls(selector.select, [req], n_cached))
        uncached = latency_stats_us(time_calls(select_backends, [req], n_uncached))
        miss = latency_stats_us(time_calls(Selector().select, variants, n_uncached))
        results[name] = {
            "target": expected.target.backend,
            "drafter": expected.drafter.backend or None,
            "cached": {**cached, "pass": cached["p50_us"] < BARS["in_process_cached_p50_us_max"]},
            "uncached": {**uncached, "pass": uncached["p50_us"] < BARS["in_process_uncached_p50_us_max"]},
            "selector_cache_miss": {**miss, "pass": miss["p50_us"] < BARS["in_process_uncached_p50_us_max"]},
        }
    return results


# ---------------------------------------------------------------- gRPC: server process


async def _echo(request: Request, context: grpc.aio.ServicerContext) -> Request:
    return request


async def _serve(conn: Connection, cache_size: int) -> None:
    settings = ServerSettings(host="127.0.0.1", port=0, grace_seconds=1.0)
    server, metrics = create_server(settings, "selector")  # same interceptors and options for both RPCs
    selector_pb2_grpc.add_BackendSelectorServicer_to_server(BackendSelectorServicer(Selector(cache_size)), server)
    echo = grpc.unary_unary_rpc_method_handler(
        _echo, request_deserializer=Request.FromString, response_serializer=Request.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO_SERVICE, {"Echo": echo}),))
    running = await start_server(server, metrics, settings, [SERVICE_NAME])
    await running.set_serving(True)
    conn.send(running.port)
    try:  # serve until the parent says stop or goes away (EOF)
        await asyncio.get_running_loop().run_in_executor(None, _recv_until_stop, conn)
    finally:
        await running.stop(1.0)


def _recv_until_stop(conn: Connection) -> None:
    try:
        while conn.recv() != "stop":  # anything else asks for the server's CPU seconds so far
            conn.send(time.process_time())
    except (EOFError, OSError):
        pass


def server_main(conn: Connection, cache_size: int) -> None:
    asyncio.run(_serve(conn, cache_size))


# ---------------------------------------------------------------- gRPC: client processes


async def _drive(port: int, method: str, callers: int, warmup: float, duration: float, barrier: Any) -> tuple:
    # Requests go out pre-serialized and responses stay raw bytes, so client work is the same for both RPCs.
    payloads = [r.SerializeToString() for r in build_requests().values()]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(method)
        for p in payloads:  # connect, warm the selector's cache, check the answer is right
            reply = await call(p)
            ok = reply == p if method == ECHO_METHOD else selector_pb2.SelectBackendsResponse.FromString(reply).target
            assert ok, f"unexpected reply from {method}"
        barrier.wait()  # every client starts its clock together
        clock = time.perf_counter_ns
        start = clock() + int(warmup * 1e9)
        end = start + int(duration * 1e9)
        latencies: list[int] = []

        async def caller(k: int) -> None:
            i = k
            while True:
                t0 = clock()
                await call(payloads[i % len(payloads)])
                t1 = clock()
                if t1 >= end:
                    return
                if t1 >= start:
                    latencies.append(t1 - t0)
                i += 1

        async def window_cpu() -> float:  # this process's CPU seconds over the measured window
            await asyncio.sleep(warmup)
            cpu = time.process_time()
            await asyncio.sleep(duration)
            return time.process_time() - cpu

        cpu, *_ = await asyncio.gather(window_cpu(), *(caller(k) for k in range(callers)))
    return len(latencies), latencies, cpu


def client_main(port: int, method: str, callers: int, warmup: float, duration: float, barrier: Any, queue: Any) -> None:
    queue.put(asyncio.run(_drive(port, method, callers, warmup, duration, barrier)))


def server_cpu(conn: Connection) -> float:
    conn.send("cpu")
    return conn.recv()


def grpc_run(ctx: Any, port: int, conn: Connection, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fixed-duration load run of `kind` ("echo" | "select") from args.client_procs processes."""
    method = ECHO_METHOD if kind == "echo" else SELECT_METHOD
    split = [
        args.concurrency // args.client_procs + (i < args.concurrency % args.client_procs)
        for i in range(args.client_procs)
    ]
    barrier, queue = ctx.Barrier(args.client_procs + 1), ctx.Queue()  # the clients and this process
    procs = [
        ctx.Process(target=client_main, args=(port, method, n, args.warmup, args.duration, barrier, queue))
        for n in split
    ]
    try:
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        time.sleep(args.warmup)
        cpu_before = server_cpu(conn)
        time.sleep(args.duration)
        server_cpu_s = server_cpu(conn) - cpu_before
        outcomes = [queue.get(timeout=args.warmup + args.duration + 120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    latencies = [ns for _, lat, _ in outcomes for ns in lat]
    calls = sum(n for n, _, _ in outcomes)
    return {
        "kind": kind,
        "calls": calls,
        "throughput_rps": round(calls / args.duration, 1),
        **{k: v for k, v in latency_stats_us(latencies).items() if k != "n"},
        "server_cpu_us_per_call": round(server_cpu_s / calls * 1e6, 1),
        "client_cpu_us_per_call": round(sum(c for _, _, c in outcomes) / calls * 1e6, 1),
        "server_cpu_util": round(server_cpu_s / args.duration, 2),
    }


def bench_grpc(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(child_conn, 4096), name="selector-bench-server")
    server.start()
    runs: list[dict[str, Any]] = []
    try:
        if not parent_conn.poll(60):
            raise RuntimeError("server did not start")
        port = parent_conn.recv()
        for _ in range(args.rounds):
            for kind in ("echo", "select"):  # alternate, so drift hits both kinds alike
                runs.append(r := grpc_run(ctx, port, parent_conn, kind, args))
                print(
                    f"  run {len(runs)}: {kind:6s} {r['throughput_rps']:8.0f} rps  p50 {r['p50_us']:7.0f} us  "
                    f"p99 {r['p99_us']:7.0f} us  CPU/call: server {r['server_cpu_us_per_call']:5.1f} us "
                    f"(util {r['server_cpu_util']:.2f}), clients {r['client_cpu_us_per_call']:5.1f} us",
                    flush=True,
                )
    finally:
        parent_conn.send("stop")
        server.join(timeout=15)
        if server.is_alive():
            server.terminate()
            server.join()

    def median(kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs if r["kind"] == kind), 2)

    keys = ("throughput_rps", "p50_us", "p99_us", "server_cpu_us_per_call", "client_cpu_us_per_call")
    summary = {k: {key: median(k, key) for key in keys} for k in ("echo", "select")}
    ratio = summary["select"]["throughput_rps"] / summary["echo"]["throughput_rps"]
    return {
        "runs": runs,
        "median": summary,
        "select_over_echo": round(ratio, 3),
        "pass": ratio >= BARS["grpc_select_over_echo_throughput_min"],
    }


# ---------------------------------------------------------------- main


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per gRPC run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each gRPC run")
    parser.add_argument("--rounds", type=int, default=2, help="echo,select pairs")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent gRPC callers in all")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes sharing the callers")
    parser.add_argument("--cached-calls", type=int, default=20_000)
    parser.add_argument("--uncached-calls", type=int, default=5_000)
    parser.add_argument("--quick", action="store_true", help="short smoke-test run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="results directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.rounds, args.cached_calls, args.uncached_calls = 1.0, 0.3, 1, 2_000, 500
    args.client_procs = max(1, min(args.client_procs, args.concurrency))

    now = dt.datetime.now(dt.UTC)
    commit = git_commit()
    print(
        f"selector bench @ {commit}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"grpcio {grpc.__version__}"
    )
    print(f"in-process: {args.cached_calls} cached / {args.uncached_calls} uncached calls per request")
    in_process = bench_in_process(args.cached_calls, args.uncached_calls)
    for name, r in in_process.items():
        cells = "  ".join(
            f"{k} p50 {r[k]['p50_us']:6.1f} p99 {r[k]['p99_us']:6.1f} {'ok' if r[k]['pass'] else 'FAIL'}"
            for k in ("cached", "uncached", "selector_cache_miss")
        )
        print(f"  {name:26s} {cells}")
    print(
        f"gRPC: {args.concurrency} callers in {args.client_procs} processes, {args.warmup}s warm-up + "
        f"{args.duration}s per run, {args.rounds} x (echo, select)"
    )
    load_before = os.getloadavg()
    over_grpc = bench_grpc(args)
    print(
        f"  median echo {over_grpc['median']['echo']['throughput_rps']:.0f} rps, select "
        f"{over_grpc['median']['select']['throughput_rps']:.0f} rps: ratio {over_grpc['select_over_echo']:.3f} "
        f"({'ok' if over_grpc['pass'] else 'FAIL'}, bar {BARS['grpc_select_over_echo_throughput_min']})"
    )

    result = {
        "benchmark": "selector",
        "utc": now.isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "loadavg_before_grpc": load_before,
            "loadavg_after_grpc": os.getloadavg(),
        },
        "bars": BARS,
        "method": {
            "in_process": (
                "time.perf_counter_ns around each call, gc enabled. cached: Selector.select on one request after "
                "a first call filled its cache. uncached: select_backends(request) called directly (no cache). "
                "selector_cache_miss: Selector.select on a fresh Selector where every call's request differs in "
                "hardware.total_memory_bytes (ignored by selection), so every call misses the cache. "
                "The uncached bar is judged on 'uncached'; selector_cache_miss is reported beside it."
            ),
            "grpc": (
                "One server process (spawn) built like start_selector: create_server(settings, 'selector') with its "
                "interceptor and options, the BackendSelector servicer, and next to it a generic-handler echo "
                f"({ECHO_METHOD}) that parses a SelectBackendsRequest and sends it back; insecure, 127.0.0.1, port 0. "
                "Load: client processes (spawn), each one grpc.aio channel shared by its callers; each caller loops "
                "over the 5 requests (pre-serialized; responses not parsed, so client work is alike for both RPCs). "
                "Each run: barrier, warm-up, then calls completing in the measured window are counted and their "
                "latencies kept. Runs alternate echo, select; ratio = median select rps / median echo rps. "
                "CPU per call: process_time of the server (asked over a pipe) and of each client over the measured "
                "window, divided by the calls counted; server_cpu_util = server CPU seconds / window seconds."
            ),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        },
        "in_process": in_process,
        "grpc": over_grpc,
        "pass": over_grpc["pass"] and all(r[k]["pass"] for r in in_process.values() for k in ("cached", "uncached")),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path = args.out / f"selector_{now:%Y-%m-%d}_{commit}.json"
    for target in (path, args.out / "selector_latest.json"):
        target.write_text(text)
    print(f"{'PASS' if result['pass'] else 'FAIL'}; wrote {path} and selector_latest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

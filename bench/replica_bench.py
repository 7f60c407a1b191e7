"""Replicas behind one address (issue 19): several CPU executors serving the same model, one client channel.

Starts --replicas `specdec-executor --device cpu` processes on free ports of 127.0.0.1, each loading the same
synthetic target and EAGLE drafter at start (--load), and reaches them all through one gRPC target,
`ipv4:127.0.0.1:p1,127.0.0.1:p2,...` (what `dns:///name:port` resolves to behind a Kubernetes headless service),
with the channel of specdec_runtime.client: round_robin, and gRPC retries on UNAVAILABLE before any response.

Two phases, each --requests greedy Generate calls, --concurrency at a time:
  spread  every replica alive; how many requests each served (GetLoads' prompt_tokens_total / prompt length).
  kill    once a third of the requests finished, one replica is stopped (--kill-signal: TERM, what Kubernetes and
          docker send first, drains running streams; KILL gives none); every request must still finish, the
          ones the stopped replica refused (or lost before any token) retried on the others.
A request counts as lost when it ends in an error or with finish reason "abort". Each finished stream's tokens
are checked against the first replica's answer to the same prompt (greedy: same weights, same tokens).

    python bench/replica_bench.py                      # 3 replicas, 48 requests per phase
    python bench/replica_bench.py --kill-signal KILL   # the stopped replica gets no grace
Writes bench/results/replicas_<date>_cpu_<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
import grpc
import torch
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_cli.local_servers import LocalServer, start_server
from specdec_runtime.client import open_channel

READY_TIMEOUT_S = 180.0  # three torch imports and loads on a loaded 2-core machine
CALL_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    request_id: str
    ok: bool
    code: str  # "OK" or the gRPC status of the final attempt
    tokens: list[int]
    finish_reason: str = ""
    detail: str = ""


def load_request(shape: dict[str, int], k: int) -> executor_pb2.LoadModelRequest:
    """The same synthetic target and EAGLE drafter (fixed seeds) on every replica."""
    return common.synthetic_eagle_load(shape, k)


def start_replicas(
    count: int, workdir: Path, load: executor_pb2.LoadModelRequest, grace_seconds: float
) -> list[LocalServer]:
    load_file = workdir / "load.json"
    load_file.write_text(json_format.MessageToJson(load))
    servers: list[LocalServer] = []
    try:
        for index in range(count):
            log_dir = workdir / f"replica-{index}"
            log_dir.mkdir()
            flags = ("--device", "cpu", "--load", str(load_file), "--grace-seconds", str(grace_seconds))
            servers.append(start_server("executor", log_dir, *flags))
    except BaseException:
        stop(servers)
        raise
    return servers


def wait_serving(servers: list[LocalServer], timeout: float = READY_TIMEOUT_S) -> None:
    """Each replica's own health (its model loaded and warm), asked at its own address."""
    deadline = time.monotonic() + timeout
    for server in servers:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if server.process.poll() is not None:
                    raise RuntimeError(f"replica {server.address} exited:\n{server.log_tail()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {server.address} not SERVING after {timeout:.0f} s")
                time.sleep(0.2)


def stop(servers: list[LocalServer]) -> None:
    for server in servers:
        if server.process.poll() is None:
            server.stop()


def served(servers: list[LocalServer], prompt_len: int) -> list[int | None]:
    """Requests each replica admitted so far (None: the replica is gone), from its own GetLoads."""
    counts: list[int | None] = []
    for server in servers:
        if server.process.poll() is not None:
            counts.append(None)
            continue
        with grpc.insecure_channel(server.address) as channel:
            loads = executor_pb2_grpc.ExecutorStub(channel).GetLoads(executor_pb2.GetLoadsRequest(), timeout=10)
        counts.append(loads.prompt_tokens_total // prompt_len)
    return counts


def generate(stub: executor_pb2_grpc.ExecutorStub, request_id: str, prompt: list[int], max_tokens: int) -> Outcome:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=prompt),
        sampling=executor_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    tokens: list[int] = []
    reason = ""
    try:
        for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            tokens.extend(response.token_ids)
            if response.HasField("finished"):
                reason = response.finished.finish_reason
    except grpc.RpcError as err:
        return Outcome(request_id, False, err.code().name, tokens, reason, (err.details() or "")[:200])
    return Outcome(request_id, reason != "abort", "OK", tokens, reason)


def run_phase(
    target: str, name: str, prompts: list[list[int]], max_tokens: int, concurrency: int, after: tuple[int, Any] | None
) -> tuple[list[Outcome], float]:
    """All prompts through one balanced channel; `after` = (n, action): run action once n requests finished."""
    finished = 0
    lock = threading.Lock()

    def one(index: int) -> Outcome:
        nonlocal finished
        outcome = generate(stub, f"{name}-{index}", prompts[index], max_tokens)
        with lock:
            finished += 1
            fire = after is not None and finished == after[0]
        if fire:
            after[1]()
        return outcome

    with open_channel(target) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        # round_robin picks among the connected replicas: let every one connect first (local, milliseconds), or
        # the first few requests all go to whichever connected first.
        grpc.channel_ready_future(channel).result(timeout=30)
        time.sleep(0.5)
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(one, range(len(prompts))))
        return outcomes, time.monotonic() - started


def summary(outcomes: list[Outcome], reference: dict[int, list[int]]) -> dict[str, Any]:
    lost = [o for o in outcomes if not o.ok]
    wrong = [o.request_id for i, o in enumerate(outcomes) if o.ok and o.tokens != reference[i]]
    return {
        "requests": len(outcomes),
        "finished": len(outcomes) - len(lost),
        "lost": [asdict(o) | {"tokens": len(o.tokens)} for o in lost],
        "lost_after_tokens": sum(1 for o in lost if o.tokens),
        "tokens_differ_from_reference": wrong,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = {**common.PRESETS["tiny"], "vocab": 512}
    prompts = common.make_prompts(args.requests, args.prompt_len, shape["vocab"], seed=1)
    with tempfile.TemporaryDirectory(prefix="specdec-replicas-") as scratch:
        workdir = args.log_dir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        servers = start_replicas(args.replicas, workdir, load_request(shape, args.k), args.grace_seconds)
        try:
            wait_serving(servers)
            target = "ipv4:" + ",".join(server.address for server in servers)
            common.log(f"{args.replicas} replicas serving; target {target}")
            # The reference tokens: each prompt on replica 0 alone (not counted in the phases below).
            started = time.monotonic()
            with grpc.insecure_channel(servers[0].address) as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                reference = {
                    i: generate(stub, f"reference-{i}", p, args.max_tokens).tokens for i, p in enumerate(prompts)
                }
            common.log(f"reference: {len(prompts)} requests on replica 0 alone in {time.monotonic() - started:.1f} s")
            before = served(servers, args.prompt_len)

            outcomes, seconds = run_phase(target, "spread", prompts, args.max_tokens, args.concurrency, None)
            after_spread = served(servers, args.prompt_len)
            spread = [a - b for a, b in zip(after_spread, before, strict=True)]  # type: ignore[operator]
            common.log(f"spread: {spread} requests per replica in {seconds:.1f} s")

            victim = servers[args.kill_index]
            kill_signal = getattr(signal, f"SIG{args.kill_signal}")
            kill_at = max(1, args.requests // 3)
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(time.monotonic())
                victim.process.send_signal(kill_signal)

            kill_outcomes, kill_seconds = run_phase(
                target, "kill", prompts, args.max_tokens, args.concurrency, (kill_at, kill)
            )
            victim.process.wait(timeout=60)
            after_kill = served(servers, args.prompt_len)
            survivors = {
                i: after_kill[i] - after_spread[i]  # type: ignore[operator]
                for i in range(len(servers))
                if after_kill[i] is not None
            }
            common.log(f"kill: replica {args.kill_index} stopped ({args.kill_signal}) after {kill_at} requests; "
                       f"survivors served {survivors}")  # fmt: skip
        finally:
            stop(servers)
    return {
        "replicas": args.replicas,
        "target": "ipv4:" + ",".join(f"127.0.0.1:<port {i}>" for i in range(args.replicas)),
        "model": {"target": shape, "drafter": "synthetic EAGLE, 1 layer", "k": args.k},
        "requests_per_phase": args.requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "spread": {"served_per_replica": spread, "seconds": round(seconds, 2), **summary(outcomes, reference)},
        "kill": {
            "replica": args.kill_index,
            "signal": args.kill_signal,
            "after_requests_finished": kill_at,
            "served_by_survivors": {str(k): v for k, v in survivors.items()},
            "victim_exit_status": victim.process.returncode,
            "seconds": round(kill_seconds, 2),
            **summary(kill_outcomes, reference),
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="Generate calls per phase")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--k", type=int, default=3, help="the drafter's speculative tokens")
    parser.add_argument("--kill-signal", choices=["TERM", "KILL"], default="TERM")
    parser.add_argument(
        "--grace-seconds", type=float, default=60.0, help="the replicas' drain time on SIGTERM (their --grace-seconds)"
    )
    parser.add_argument("--kill-index", type=int, default=1, help="which replica is stopped in the kill phase")
    parser.add_argument("--out", type=Path, default=common.REPO / "bench" / "results")
    parser.add_argument("--no-write", action="store_true", help="print the report, write no file")
    parser.add_argument("--log-dir", type=Path, help="keep the replicas' logs here (replica-N/executor.log)")
    args = parser.parse_args(argv)
    if args.replicas < 2 or not 0 <= args.kill_index < args.replicas:
        parser.error("--replicas must be >= 2 and --kill-index one of them")
    if args.requests < 3 or args.concurrency < 1:
        parser.error("--requests must be >= 3 and --concurrency >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    commit, dirty = common.commit_id()
    report = {"bench": "replicas", "commit": commit, "dirty": dirty, "versions": common.versions(), **measure(args)}
    if args.no_write:
        print(json.dumps(report, indent=1))
    else:
        common.write_result(args.out, "replicas", torch.device("cpu"), commit, report)
    return report


if __name__ == "__main__":
    report = main()
    lost = report["spread"]["lost"] or report["kill"]["lost"]
    sys.exit(1 if lost or 0 in report["spread"]["served_per_replica"] else 0)

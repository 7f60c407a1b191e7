"""The gateway's own CPU per streamed token and per request (issue 35), against a stand-in executor.

bench/gateway_bench.py measures the gateway beside a real executor, whose steps take most of the two cores of the
CPU host and make the gateway's share hard to read. Here a stand-in executor (a grpc.aio server in this process,
no model) answers Generate with one message of one token (text and log probability) per stream every --step-ms,
as the executor does at one token per step, and the gateway's CPU seconds (/proc) are read over many messages:

- per token: --streams concurrent streams of --tokens tokens each (logprobs=0, as gateway_bench asks), the
  gateway's CPU over the tokens streamed (its per-request work included, spread over --tokens);
- per request: --streams concurrent requests of one token each, repeated --request-rounds times, the gateway's CPU
  over the requests.

--arrivals ROUNDS measures instead how the gateway hands a burst of --streams requests, all sent at once, to the
executor against a client calling the stand-in directly: the stand-in records when each Generate reaches it, and
each round reports the first, median and last arrival after the client was told to start (its clock and the
stand-in's are the host's CLOCK_MONOTONIC), ROUNDS rounds of --arrival-tokens tokens a path, alternating which
path goes first. An engine starts a step with the requests it has, so the later they come, the more of them wait
a step longer for their first token: the arrivals are what the time to first token at 64 streams is made of.

The client is gateway_bench's (its own process, h11 keep-alive connections). Pass gateway flags after `--`:

    python bench/gateway_cpu_bench.py                                  # the gateway as installed
    python bench/gateway_cpu_bench.py -- --event-loop asyncio --http-parser h11
    python bench/gateway_cpu_bench.py --arrivals 8 -- --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import gateway_bench


def stand_in_executor(step_s: float, lockstep: bool = False, arrivals: list[float] | None = None) -> tuple[str, Any]:
    """A grpc.aio Executor server (Generate only) on a free port, in a thread of this process: its address and a
    function that stops it. `lockstep`: every stream's next token comes at the same instant (the next multiple of
    `step_s` on the loop's clock), as the executor's engine steps its whole batch at once; else each stream sleeps
    `step_s` on its own, and the streams drift apart. `arrivals`: each Generate's time.monotonic() on arrival is
    appended to it."""
    import grpc

    from specdec.v1 import executor_pb2, executor_pb2_grpc

    class Executor(executor_pb2_grpc.ExecutorServicer):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            if arrivals is not None:
                arrivals.append(time.monotonic())
            n = request.sampling.max_tokens
            prompt = len(request.token_ids.ids) or 1
            loop = asyncio.get_running_loop()
            for index in range(n):
                await asyncio.sleep(step_s - loop.time() % step_s if lockstep else step_s)
                token = 1 + (index * 7919 + prompt) % 1000
                message = executor_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token], text=" tok")
                message.logprobs.add(token_id=token, logprob=-0.5)
                if index == n - 1:
                    message.finished.finish_reason = "length"
                    message.finished.prompt_tokens, message.finished.completion_tokens = prompt, n
                yield message

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(Executor(), server)
        state["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state["server"] = server
        ready.set()
        await server.wait_for_termination()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    ready.wait(30)

    def stop() -> None:
        """Stop it if it stops in time; its thread is a daemon, so a server slow to stop keeps nothing alive."""
        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(state["server"].stop(None), loop).result(10)

    return f"127.0.0.1:{state['port']}", stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream in a per-token round")
    parser.add_argument("--rounds", type=int, default=3, help="per-token rounds")
    parser.add_argument("--request-rounds", type=int, default=20, help="rounds of one-token requests")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the stand-in executor's time per token")
    parser.add_argument(
        "--lockstep", action="store_true", help="every stream's token at the same instant each step, as an engine step"
    )
    parser.add_argument(
        "--arrivals", type=int, default=0, metavar="ROUNDS", help="measure the burst's arrivals instead (ROUNDS a path)"
    )
    parser.add_argument("--arrival-tokens", type=int, default=1, help="tokens a stream asks for in an arrivals round")
    parser.add_argument("gateway_args", nargs="*", help="flags for specdec-gateway (after --)")
    parser.add_argument("--gateway-python", help="the interpreter that runs the gateway (default: this one)")
    args = parser.parse_args()
    result = {
        "gateway_args": args.gateway_args,
        "lockstep": args.lockstep,
        **against_stand_in(args, args.gateway_args, args.gateway_python),
        "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps(result), flush=True)


def against_stand_in(args: argparse.Namespace, gateway_args: list[str], python: str | None = None) -> dict[str, Any]:
    """A gateway (`gateway_args`; run by `python`, default this interpreter) in front of the stand-in executor:
    the arrivals (args.arrivals rounds a path), else the gateway's CPU, and the gateway's exit status."""
    from specdec_cli.local_servers import start_server

    arrivals: list[float] = []
    address, stop_executor = stand_in_executor(args.step_ms / 1e3, args.lockstep, arrivals)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        flags = ["--executor", address, "--served-model-name", "bench", *gateway_args]
        gateway = start_server("gateway", workdir, *flags, python=python)
        rng = random.Random(0)
        prompts = [[rng.randrange(1, 1000) for _ in range(16)] for _ in range(args.streams)]
        (workdir / "prompts.json").write_text(json.dumps(prompts))
        client_args = argparse.Namespace(max_tokens=args.tokens)
        client = gateway_bench.Client("gateway", gateway.address, client_args, workdir / "prompts.json")
        clients = [client]
        try:
            if args.arrivals:
                clients.append(gateway_bench.Client("direct", address, client_args, workdir / "prompts.json"))
                measured = measure_arrivals(args, clients, gateway.process.pid, arrivals)
            else:
                measured = measure_cpu(args, client, gateway.process.pid)
        finally:
            for each in clients:
                each.close()
            status = gateway.stop()
            stop_executor()
    return {**measured, "gateway_exit": status}


def measure_cpu(args: argparse.Namespace, client: gateway_bench.Client, pid: int) -> dict[str, Any]:
    """The gateway's CPU per streamed token and per one-token request."""
    client.run("warmup")
    per_token = []
    for _ in range(args.rounds):
        before = gateway_bench.tree_cpu_seconds(pid)
        answer = client.run("round")
        tokens = sum(len(t) for t in answer["tokens"])
        assert tokens == args.streams * args.tokens, tokens
        per_token.append((gateway_bench.tree_cpu_seconds(pid) - before) / tokens * 1e6)
    before = gateway_bench.tree_cpu_seconds(pid)
    for _ in range(args.request_rounds):
        client.run("tokens 1")
    per_request = (gateway_bench.tree_cpu_seconds(pid) - before) / (args.request_rounds * args.streams) * 1e3
    return {
        "us_per_token": round(statistics.median(per_token), 1),
        "us_per_token_rounds": [round(x, 1) for x in per_token],
        "ms_per_request_one_token": round(per_request, 3),
    }


def measure_arrivals(
    args: argparse.Namespace, clients: list[gateway_bench.Client], pid: int, arrivals: list[float]
) -> dict[str, Any]:
    """Rounds of a burst of --streams requests a path, alternating which goes first: when the stand-in saw each
    Generate, in ms after the client was told to start (first, median, last), and the time to first token p50."""
    by_path: dict[str, list[dict[str, float]]] = {c.path: [] for c in clients}
    for client in clients:
        client.run("warmup")
        client.run("warmup")
    for index in range(args.arrivals):
        for client in clients if index % 2 == 0 else clients[::-1]:
            arrivals.clear()
            before = gateway_bench.tree_cpu_seconds(pid)
            answer = client.run(f"tokens {args.arrival_tokens}")
            cpu = gateway_bench.tree_cpu_seconds(pid) - before
            offsets = sorted((at - answer["started_monotonic"]) * 1e3 for at in arrivals)
            assert len(offsets) == args.streams, len(offsets)
            measured = {
                "first_ms": round(offsets[0], 2),
                "median_ms": round(statistics.median(offsets), 2),
                "last_ms": round(offsets[-1], 2),
                "ttft_p50_ms": round(statistics.median(answer["ttfts"]) * 1e3, 2),
            }
            if client.path == "gateway":  # when the HTTP client had written the median and the last request
                sent = sorted((at - answer["started_monotonic"]) * 1e3 for at in answer["sent_monotonic"])
                measured["client_sent_median_ms"] = round(statistics.median(sent), 2)
                measured["client_sent_last_ms"] = round(sent[-1], 2)
                measured["gateway_cpu_ms_per_request"] = round(cpu / args.streams * 1e3, 3)
            by_path[client.path].append(measured)
    summary = {
        path: {key: gateway_bench.spread([r[key] for r in rounds]) for key in rounds[0]}
        for path, rounds in by_path.items()
    }
    return {"arrivals": summary, "arrival_rounds": by_path, "streams": args.streams}


if __name__ == "__main__":
    main()

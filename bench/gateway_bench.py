"""The gateway's cost (issue 35): --streams concurrent greedy streams, straight to an executor over gRPC and through
`specdec-gateway` (POST /v1/completions, server-sent events) to the same executor, in interleaved rounds.

Each path has its own client process, started once and warmed up (its gRPC channel, or its --streams keep-alive
HTTP/1.1 connections, as an OpenAI SDK client keeps them), then told round by round to run; only one runs at a
time, the order alternating. The HTTP client is h11 (the parser uvicorn uses) over asyncio streams, so that the
client costs about what the gRPC client does; each round reports both clients' CPU seconds beside the gateway's
and the executor's, to show the client is not what is measured.

Reports tokens/s of each path (every stream's tokens over the round's wall time): the median over rounds, the
spread (min, max) and the ratio, both as the medians' ratio and as the median of the rounds' ratios (round i of
each path ran back to back, so the host's load drifts less within a pair; the bar, >= 0.95, is met when both
are); the time to first token p50 of each and the gateway's overhead, the median of the per-pair differences (the
bar: <= 5 ms); and whether every stream's tokens, in every round, equal the first direct round's for the same
prompt (greedy). Both paths ask for logprobs=0: the gateway names each token (`token_id:N`), the direct path
reads the same entries.

Each round also reports the share of its wall time the executor's threads spent runnable but waiting for a core
(/proc schedstat): on a small shared host the rounds' pace is the executor's, and whatever else runs (the gateway,
the clients, other jobs) shows up there. At 64 streams the time to first token moves in steps: the executor
starts a step with the requests that have arrived and the rest wait for the next one, so a round's p50 jumps by
a step (tens of ms) with the arrival order. After the rounds, --single-rounds requests of one stream alone,
alternating path request by request, measure the latency the gateway adds without those steps.

Before a timed round the HTTP client opens again, untimed, any keep-alive connection the gateway closed while the
other path ran (uvicorn closes one idle for 5 s); the gRPC channel stays connected, so both paths start a round
connected. Each round counts the connections opened again before it and during it.

--gateway-args passes flags to the gateway (the production configuration: uvloop and httptools installed, and
"--workers N"), --gateway-python runs it with another interpreter (the image's Python 3.12, say, while the
executor stays in a venv with torch). After the rounds, --arrival-rounds rounds of gateway_cpu_bench.py --arrivals
with the same gateway in front of a stand-in executor report when each request of a burst reaches an executor,
through the gateway and direct (the executor here cannot say when a Generate came); --closed-rounds adds a closed
loop, each stream sending its next request as soon as its last one ended, whose first tokens no longer wait for a
burst to be admitted (an extra figure, not the bar).

On the CPU the executor gets one intra-op thread (--executor-threads 1): with torch's default (a thread per core)
the executor shares its cores with the gateway, both clients and anything else on the host, and each of the
hundreds of small parallel regions of a step waits for a descheduled worker: steps 20-30x slower while another
process runs, which is what stalled gateway rounds (more processes busy) in the first CPU run. One thread leaves
the other cores to the gateway and the clients, as a GPU host does.

    python bench/gateway_bench.py                          # tiny synthetic Llama + EAGLE drafter on the CPU
    python bench/gateway_bench.py --gateway-args "--workers 4"     # the gateway as four processes
    python bench/gateway_bench.py --device cuda --target /root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --drafter eagle3=drafters/smollm2-eagle3           # SmolLM2 with its EAGLE-3 drafter on a GPU
Writes bench/results/gateway_<date>_<device>_<commit>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 600.0
ROUND_TIMEOUT_S = 600.0


# ---- the client processes (no torch: `--client` imports only grpc, h11 and the stubs) --------------------------
class HttpStream:
    """One keep-alive HTTP/1.1 connection (h11 over asyncio streams) reading a server-sent event stream."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.conn: Any = None
        self.reopened = 0  # connections opened again after the first (the server closed an idle one)
        self.sent = 0.0  # time.monotonic() when the last request was written

    async def _open(self) -> None:
        import h11

        if self.writer is not None:
            self.writer.close()
            self.reopened += 1
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.conn = h11.Connection(h11.CLIENT)

    async def reopen_if_closed(self) -> None:
        """Open the connection again, untimed, if the server closed it while idle (uvicorn's 5 s keep-alive
        timeout, which the other path's round can outlast): the gRPC channel of the direct path stays connected
        between rounds, so a timed round starts with both paths connected."""
        import h11

        closed = self.reader is not None and self.reader.at_eof()
        if closed or (self.conn is not None and self.conn.our_state is not h11.IDLE):
            await self._open()

    async def completion(self, body: dict[str, Any]) -> tuple[float, list[int]]:
        """Time to the first token and the tokens of one streamed completion. A kept-alive connection the server
        closed meanwhile (uvicorn's keep-alive timeout) is reopened and the request sent again, as HTTP clients do
        for a request nothing was answered to; the time of the first try counts."""
        import h11

        started = time.perf_counter()
        reused = self.conn is not None and self.conn.our_state is h11.IDLE
        if not reused:
            await self._open()
        try:
            return await self._exchange(body, started)
        except _ClosedUnanswered:
            if not reused:
                raise
            await self._open()
            return await self._exchange(body, started)

    async def _exchange(self, body: dict[str, Any], started: float) -> tuple[float, list[int]]:
        import h11

        conn, data = self.conn, json.dumps(body).encode()
        headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json")]
        headers.append(("Content-Length", str(len(data))))
        request = conn.send(h11.Request(method="POST", target="/v1/completions", headers=headers))
        self.writer.write(request + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
        self.sent = time.monotonic()  # handed to the kernel (the writer writes at once when its buffer is empty)
        first, tokens, pending, answered = None, [], b"", False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                if answered:
                    raise
                raise _ClosedUnanswered from None
            if event is h11.NEED_DATA:
                try:
                    received = await self.reader.read(1 << 16)
                except ConnectionError:
                    received = b""
                conn.receive_data(received)
            elif isinstance(event, h11.Response):
                answered = True
                if event.status_code != 200:
                    raise RuntimeError(f"the gateway answered {event.status_code}")
            elif isinstance(event, h11.Data):
                *events, pending = (pending + bytes(event.data)).split(b"\n\n")
                for line in events:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"error in the stream: {chunk['error']}")
                    names = chunk["choices"][0]["logprobs"]["tokens"] if chunk["choices"] else []
                    if first is None and names:
                        first = time.perf_counter() - started
                    tokens.extend(int(name.removeprefix("token_id:")) for name in names)
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                return first or float("nan"), tokens
            elif isinstance(event, h11.ConnectionClosed):
                if not answered:
                    raise _ClosedUnanswered
                self.conn = None
                return first or float("nan"), tokens


class _ClosedUnanswered(Exception):
    """The server closed the connection before answering the request."""


async def direct_stream(stub: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    from specdec.v1 import executor_pb2

    request = executor_pb2.GenerateRequest(
        request_id=f"direct-{random.getrandbits(64):016x}",
        token_ids=executor_pb2.TokenIds(ids=prompt),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0),
    )
    started, first, tokens = time.perf_counter(), None, []
    async for chunk in stub.Generate(request, timeout=ROUND_TIMEOUT_S):
        if first is None and chunk.logprobs:
            first = time.perf_counter() - started
        tokens.extend(entry.token_id for entry in chunk.logprobs)
    return first or float("nan"), tokens


async def client_main(args: argparse.Namespace) -> None:
    """One path's client: a line on stdin runs a round (all streams at once), a JSON line on stdout answers it."""
    import grpc

    from specdec.v1 import executor_pb2_grpc
    from specdec_runtime.client import BALANCING_OPTIONS

    prompts = json.loads(Path(args.prompts).read_text())
    channel = grpc.aio.insecure_channel(args.address, options=list(BALANCING_OPTIONS))
    stub = executor_pb2_grpc.ExecutorStub(channel)
    host, port = args.address.rsplit(":", 1)
    connections = [HttpStream(host, int(port)) for _ in prompts]
    body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, logprobs=0)

    def streams(max_tokens: int) -> list[Any]:
        if args.client == "direct":
            return [direct_stream(stub, prompt, max_tokens) for prompt in prompts]
        asked = {**body, "max_tokens": max_tokens}
        return [c.completion({**asked, "prompt": p}) for c, p in zip(connections, prompts, strict=True)]

    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        what = line.split()
        if what[0] == "closed":  # "closed S": for S seconds each stream sends its next request when one ends
            deadline = time.perf_counter() + float(what[1])

            async def closed_loop(index: int, deadline: float = deadline) -> list[float]:
                lengths, firsts = random.Random(index), []  # lengths of 8 to --max-tokens: the streams drift apart
                while time.perf_counter() < deadline:
                    tokens = lengths.randint(min(8, args.max_tokens), args.max_tokens)
                    if args.client == "direct":
                        first, _ = await direct_stream(stub, prompts[index], tokens)
                    else:
                        asked = {**body, "max_tokens": tokens, "prompt": prompts[index]}
                        first, _ = await connections[index].completion(asked)
                    firsts.append(first)
                return firsts[1:]  # the first request of each stream is the burst's

            await asyncio.gather(*(c.reopen_if_closed() for c in connections if args.client == "gateway"))
            firsts = await asyncio.gather(*(closed_loop(index) for index in range(len(prompts))))
            print(json.dumps({"ttfts": [first for each in firsts for first in each]}), flush=True)
            continue
        if what[0] == "single":  # "single N": one stream of N tokens alone, its time to first token
            if args.client == "direct":
                first, _ = await direct_stream(stub, prompts[0], int(what[1]))
            else:
                await connections[0].reopen_if_closed()
                first, _ = await connections[0].completion({**body, "max_tokens": int(what[1]), "prompt": prompts[0]})
            print(json.dumps({"ttft": first}), flush=True)
            continue
        max_tokens = args.max_tokens if what == ["round"] else 4  # "warmup": connections, channel, caches
        if what[0] == "tokens":  # "tokens N" (gateway_cpu_bench.py): N tokens a stream
            max_tokens = int(what[1])
        closed = sum(c.reopened for c in connections)
        await asyncio.gather(*(c.reopen_if_closed() for c in connections if args.client == "gateway"))
        reopened = sum(c.reopened for c in connections)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        started_monotonic = time.monotonic()  # CLOCK_MONOTONIC, the same in every process of the host
        started = time.perf_counter()
        results = await asyncio.gather(*streams(max_tokens))
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        answer = {
            "wall_s": wall,
            "client_cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
            "ttfts": [first for first, _ in results],
            "tokens": [tokens for _, tokens in results],
            "reopened": sum(c.reopened for c in connections) - reopened,
            "reopened_before": reopened - closed,
            "started_monotonic": started_monotonic,
            "sent_monotonic": [c.sent for c in connections] if args.client == "gateway" else [],
        }
        print(json.dumps(answer), flush=True)
    await channel.close()


# ---- the parent: servers, rounds, report ------------------------------------------------------------------------
class Client:
    def __init__(self, path: str, address: str, args: argparse.Namespace, prompts: Path) -> None:
        command = [sys.executable, __file__, "--client", path, "--address", address, "--prompts", str(prompts)]
        command += ["--max-tokens", str(args.max_tokens)]
        self.path = path
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def single(self, tokens: int) -> float:
        """The time to first token of one stream alone."""
        return float(self.run(f"single {tokens}")["ttft"])

    def run(self, what: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.path} client exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and of its children, theirs included (a gateway's --workers)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # the parent's pid
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return cpu_seconds(pid) + sum(tree_cpu_seconds(child) for child in children)


def run_queue_seconds(pid: int) -> float:
    """Seconds the process's threads, all of them, have spent runnable but waiting for a core (Linux
    /proc/PID/task/*/schedstat; NaN elsewhere): a round's share of it says how much the host's cores were
    contended, the executor's most of all (its steps are the rounds' pace)."""
    total, found = 0.0, False
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1]) / 1e9
            found = True
        except (OSError, IndexError, ValueError):
            continue
    return total if found else float("nan")


def summarize(path: str, answer: dict[str, Any], servers: dict[str, float]) -> dict[str, Any]:
    ttfts = sorted(answer["ttfts"])
    total = sum(len(tokens) for tokens in answer["tokens"])
    return {
        "path": path,
        "wall_s": round(answer["wall_s"], 4),
        "tokens": total,
        "tokens_per_s": round(total / answer["wall_s"], 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 2),
        "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, 2),
        "ttfts_ms": [round(t * 1e3, 1) for t in ttfts],  # every stream's, sorted: the engine steps show as groups
        "cpu_s": {"client": round(answer["client_cpu_s"], 3), **{k: round(v, 3) for k, v in servers.items()}},
        "connections_reopened": answer.get("reopened", 0),
        "connections_reopened_untimed": answer.get("reopened_before", 0),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def measure(args: argparse.Namespace, executor: Any, gateway: Any, workdir: Path) -> dict[str, Any]:
    import common

    rng = random.Random(0)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    clients = {
        "direct": Client("direct", executor.address, args, prompts_file),
        "gateway": Client("gateway", gateway.address, args, prompts_file),
    }
    pids = {"executor": executor.process.pid, "gateway": gateway.process.pid}
    rounds: list[dict[str, Any]] = []
    tokens: list[list[list[int]]] = []
    try:
        for client in clients.values():
            client.run("warmup")
            client.run("warmup")
        for index in range(args.rounds):
            order = ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]
            for path in order:
                before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
                waited = run_queue_seconds(executor.process.pid)
                answer = clients[path].run("round")
                servers = {name: tree_cpu_seconds(pid) - before[name] for name, pid in pids.items()}
                waited = run_queue_seconds(executor.process.pid) - waited
                rounds.append({"round": index, **summarize(path, answer, servers)})
                rounds[-1]["executor_run_queue_share"] = round(waited / answer["wall_s"], 3)
                tokens.append(answer["tokens"])
                r = rounds[-1]
                common.log(
                    f"round {index} {path}: {r['tokens_per_s']} tok/s, ttft p50 {r['ttft_p50_ms']} ms, "
                    f"cpu s {r['cpu_s']}, executor waiting for a core {r['executor_run_queue_share']:.0%} of it"
                )
        single: dict[str, list[float]] = {"direct": [], "gateway": []}
        for index in range(args.single_rounds):  # one stream at a time, the paths alternating request by request
            for path in ("direct", "gateway") if index % 2 == 0 else ("gateway", "direct"):
                single[path].append(clients[path].single(args.single_tokens))
        closed: dict[str, list[float]] = {"direct": [], "gateway": []}
        for index in range(args.closed_rounds):  # steady load: requests no longer start together
            for path in ("direct", "gateway") if index % 2 == 0 else ("gateway", "direct"):
                ttfts = clients[path].run(f"closed {args.closed_seconds}")["ttfts"]
                closed[path].append(statistics.median(ttfts) * 1e3)
                common.log(f"closed loop {index} {path}: ttft p50 {closed[path][-1]:.2f} ms of {len(ttfts)} requests")
    finally:
        for client in clients.values():
            client.close()
    reference = tokens[next(i for i, r in enumerate(rounds) if r["path"] == "direct")]
    differing = sorted({i for got in tokens for i, stream in enumerate(got) if stream != reference[i]})
    where_differing = {  # which rounds (and paths) gave a differing stream: batch effects show on both paths
        i: [f"{r['round']}:{r['path']}" for r, got in zip(rounds, tokens, strict=True) if got[i] != reference[i]]
        for i in differing
    }
    direct_varies = sorted(i for i, where in where_differing.items() if any(w.endswith("direct") for w in where))
    by_path = {p: [r for r in rounds if r["path"] == p] for p in ("direct", "gateway")}
    tps = {p: spread([r["tokens_per_s"] for r in rs]) for p, rs in by_path.items()}
    ttft = {p: spread([r["ttft_p50_ms"] for r in rs]) for p, rs in by_path.items()}
    pairs = list(zip(by_path["direct"], by_path["gateway"], strict=True))  # round i of each path
    ratios = [g["tokens_per_s"] / d["tokens_per_s"] for d, g in pairs]
    overheads = [g["ttft_p50_ms"] - d["ttft_p50_ms"] for d, g in pairs]
    ratio = round(tps["gateway"]["median"] / tps["direct"]["median"], 4)
    single_overheads = [(g - d) * 1e3 for d, g in zip(single["direct"], single["gateway"], strict=True)]
    return {
        "rounds": rounds,
        "tokens_per_s": tps,
        "throughput_ratio": ratio,
        "throughput_ratio_per_round": {**spread(ratios), "values": [round(x, 4) for x in ratios]},
        "ttft_p50_ms": ttft,
        "ttft_p50_overhead_ms": round(statistics.median(overheads), 2),
        "ttft_p50_overhead_ms_per_round": {**spread(overheads), "values": [round(x, 2) for x in overheads]},
        "single_stream_ttft_ms": {
            "requests_per_path": args.single_rounds,
            "tokens": args.single_tokens,
            **{p: spread([round(x * 1e3, 2) for x in v]) for p, v in single.items() if v},
            "overhead": {**spread([round(x, 2) for x in single_overheads]), "note": "gateway - direct, request pairs"}
            if single_overheads
            else None,
        },
        "closed_loop_ttft_p50_ms": {
            "note": "not the bar: each stream sends its next request (8 to max_tokens tokens, drawn per stream) as "
            f"soon as its last one ended, for {args.closed_seconds} s a round; p50 over the round's requests but each "
            "stream's first",
            **{p: spread([round(x, 2) for x in v]) for p, v in closed.items()},
            "overhead": spread([round(g - d, 2) for d, g in zip(closed["direct"], closed["gateway"], strict=True)]),
        }
        if args.closed_rounds
        else None,
        "streams": args.streams,
        "streams_checked": args.streams * len(rounds),
        "streams_with_tokens_differing_from_direct": differing,
        "rounds_where_differing": where_differing,
        # streams whose direct rounds disagree among themselves: the executor's run-to-run variance (bf16 GEMMs
        # pick kernels by row count, so a request prefilled alone or beside another rounds differently), not the
        # gateway's
        "streams_differing_between_direct_rounds": direct_varies,
        "tokens_equal": not differing,
        "bars": {"throughput_ratio_min": 0.95, "ttft_p50_overhead_ms_max": 5.0},
        "met": {  # both estimates of the ratio: the medians' ratio and the median of the rounds' ratios
            "throughput": ratio >= 0.95 and statistics.median(ratios) >= 0.95,
            "ttft": statistics.median(overheads) <= 5.0,
            "tokens_equal": not differing,
        },
    }


@contextlib.contextmanager
def executor_environment(threads: int) -> Iterator[None]:
    """OMP_NUM_THREADS for the executor process started inside (0: torch's default, a thread per core)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def default_executor_threads(device: str) -> int:
    """1 on the CPU (see the module's docstring), torch's default elsewhere."""
    return 1 if device == "cpu" else 0


def load_request(args: argparse.Namespace, workdir: Path) -> tuple[Any, Path | None, dict[str, Any]]:
    """The LoadModelRequest, the --model-root it needs (None: synthetic) and the report's model description."""
    import common

    from specdec.v1 import common_pb2, executor_pb2

    dtype = common_pb2.DTYPE_FLOAT32 if args.device == "cpu" else common_pb2.DTYPE_BFLOAT16
    if args.target is None:
        shape = common.PRESETS[args.preset]
        args.vocab = shape["vocab"]
        load = common.synthetic_eagle_load(shape, args.k, dtype, 2048)
        return load, None, {"preset": args.preset, **shape, "drafter": f"synthetic EAGLE, 1 layer, k = {args.k}"}
    root = workdir / "models"  # the GGUF and the drafter copied under one --model-root
    root.mkdir()
    shutil.copy(args.target, root / args.target.name)
    load = executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path=args.target.name), dtype=dtype)
    load.num_kv_blocks = 4096
    model: dict[str, Any] = {"target": args.target.name}
    if args.drafter:
        method, _, directory = args.drafter.partition("=")
        shutil.copytree(directory, root / Path(directory).name)
        load.draft.method = common_pb2.SpecMethod.Value(f"SPEC_METHOD_{method.upper()}")
        load.draft.num_speculative_tokens = args.k
        load.draft.source.path = Path(directory).name
        model["drafter"] = f"{method} {directory}, k = {args.k}"
    args.vocab = args.target_vocab
    return load, root, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="synthetic model shape (bench/common.py PRESETS)")
    parser.add_argument("--target", type=Path, help="a GGUF or checkpoint to serve instead of a synthetic model")
    parser.add_argument("--drafter", help="METHOD=DIR, the --target's drafter (e.g. eagle3=drafters/smollm2-eagle3)")
    parser.add_argument("--target-vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--executor-threads", type=int, help="the executor's OMP_NUM_THREADS (0: torch's default)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per path, alternating which goes first")
    parser.add_argument("--k", type=int, default=3, help="drafts per step")
    parser.add_argument(
        "--single-rounds", type=int, default=40, help="then this many single-stream requests per path, alternating"
    )
    parser.add_argument("--single-tokens", type=int, default=4, help="tokens a single-stream request asks for")
    parser.add_argument(
        "--closed-rounds",
        type=int,
        default=0,
        help="then rounds a path of a closed loop (each stream's next request, of 8 to --max-tokens tokens, when its "
        "last ends; not the bar)",
    )
    parser.add_argument("--closed-seconds", type=float, default=10.0, help="how long a closed-loop round runs")
    parser.add_argument("--gateway-args", default="", help='flags for specdec-gateway, one string (e.g. "--workers 4")')
    parser.add_argument("--gateway-python", help="the interpreter that runs the gateway (default: this one)")
    parser.add_argument(
        "--arrival-rounds",
        type=int,
        default=8,
        help="then rounds a path of gateway_cpu_bench.py --arrivals (the same gateway flags, a stand-in executor)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--client", choices=("direct", "gateway"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return

    import common
    import torch
    from google.protobuf import json_format

    from specdec_cli.local_servers import start_server

    if args.executor_threads is None:
        args.executor_threads = default_executor_threads(args.device)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        load, root, model = load_request(args, workdir)
        (workdir / "load.json").write_text(json_format.MessageToJson(load))
        executor_args = ["--device", args.device, "--load", str(workdir / "load.json")]
        executor_args += ["--model-root", str(root)] if root else []
        with executor_environment(args.executor_threads):
            executor = start_server("executor", workdir, *executor_args)
        gateway = None
        try:
            wait_serving(executor)
            flags = ["--executor", executor.address, "--served-model-name", "bench", *shlex.split(args.gateway_args)]
            gateway = start_server("gateway", workdir, *flags, python=args.gateway_python)
            common.log(f"gateway: {gateway.log_tail(3)}")
            measured = measure(args, executor, gateway, workdir)
        finally:
            statuses = {"gateway": gateway.stop() if gateway else None, "executor": executor.stop()}
    if args.arrival_rounds:
        measured["stand_in_arrivals"] = stand_in_arrivals(args)
        statuses["stand_in_gateway"] = measured["stand_in_arrivals"].pop("gateway_exit")
    report = {
        **common.provenance("gateway", device),
        "versions": common.versions(),
        "host": {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if v is not None},
        "model": model,
        **measured,
        "exit_statuses": statuses,
    }
    keys = ("tokens_per_s", "throughput_ratio", "ttft_p50_ms", "ttft_p50_overhead_ms", "tokens_equal")
    common.log(json.dumps({k: report[k] for k in keys}))
    common.write_result(args.out, "gateway", device, report["commit"], report)


def stand_in_arrivals(args: argparse.Namespace) -> dict[str, Any]:
    """gateway_cpu_bench.py --arrivals with this run's gateway flags: when each request of a burst of --streams
    reaches an executor, through the gateway and direct. The executor here has no model (a stand-in in this
    process, which records each Generate's arrival), so the figures say how the gateway hands a burst on, not how
    this run's executor took it."""
    import common
    import gateway_cpu_bench

    measured = gateway_cpu_bench.against_stand_in(
        argparse.Namespace(
            streams=args.streams, tokens=1, step_ms=20.0, lockstep=False, arrivals=args.arrival_rounds, arrival_tokens=1
        ),
        shlex.split(args.gateway_args),
        args.gateway_python,
    )
    summary = {path: {k: v["median"] for k, v in figures.items()} for path, figures in measured["arrivals"].items()}
    common.log(f"arrivals at a stand-in executor, ms after the start (median of {args.arrival_rounds}): {summary}")
    return measured


def wait_serving(executor: Any) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(executor.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1:
                    return
            except grpc.RpcError:
                pass
            if executor.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the executor is not SERVING:\n{executor.log_tail()}")
            time.sleep(0.2)


if __name__ == "__main__":
    main()

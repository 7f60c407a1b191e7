"""The gateway's cost (issue 35): --streams concurrent greedy streams, straight to an executor over gRPC and through
`specdec-gateway` (POST /v1/completions, server-sent events) to the same executor, in alternating rounds.

Reports tokens/s of each path (every stream's tokens over the round's wall time), their ratio (the bar: >= 0.95),
the time to first token p50 of each and the gateway's overhead (the bar: <= 5 ms), and checks that every stream's
tokens through the gateway equal the direct call's for the same prompt (greedy). The model is synthetic, without a
tokenizer, so both paths ask for logprobs=0: the gateway then names each token (`token_id:N`), and the direct path
does the same work on the executor.

    python bench/gateway_bench.py                          # tiny synthetic Llama + EAGLE drafter on the CPU
    python bench/gateway_bench.py --device cuda --preset smollm2
Writes bench/results/gateway_<date>_<device>_<commit>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import grpc
import httpx2
import torch
from google.protobuf import json_format

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_cli.local_servers import LocalServer, start_server
from specdec_runtime.client import BALANCING_OPTIONS

READY_TIMEOUT_S = 300.0


async def wait_serving(address: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + READY_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)


async def direct_stream(stub: Any, index: int, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    request = executor_pb2.GenerateRequest(
        request_id=f"direct-{index}-{random.getrandbits(32)}",
        token_ids=executor_pb2.TokenIds(ids=prompt),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0),
    )
    started, first, tokens = time.perf_counter(), None, []
    async for chunk in stub.Generate(request, timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        tokens.extend(entry.token_id for entry in chunk.logprobs)
    return first or float("nan"), tokens


async def gateway_stream(http: Any, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, logprobs=0)
    started, first, tokens = time.perf_counter(), None, []
    async with http.stream("POST", url, json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            names = chunk["choices"][0]["logprobs"]["tokens"] if chunk.get("choices") else []
            if first is None and names:
                first = time.perf_counter() - started
            tokens.extend(int(name.removeprefix("token_id:")) for name in names)
    return first or float("nan"), tokens


async def run_round(path: str, streams: list[Any]) -> dict[str, Any]:
    started = time.perf_counter()
    results = await asyncio.gather(*streams)
    wall = time.perf_counter() - started
    ttfts = sorted(first for first, _ in results)
    total = sum(len(tokens) for _, tokens in results)
    return {
        "path": path,
        "wall_s": round(wall, 4),
        "tokens": total,
        "tokens_per_s": round(total / wall, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 2),
        "ttft_p90_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, 2),
        "_tokens": [tokens for _, tokens in results],
    }


async def measure(args: argparse.Namespace, executor: LocalServer, gateway: LocalServer) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    url = f"http://{gateway.address}/v1/completions"
    limits = httpx2.Limits(max_connections=args.streams * 2, max_keepalive_connections=args.streams * 2)
    async with (
        grpc.aio.insecure_channel(executor.address, options=list(BALANCING_OPTIONS)) as channel,
        httpx2.AsyncClient(timeout=600, limits=limits) as http,
    ):
        stub = executor_pb2_grpc.ExecutorStub(channel)

        def direct() -> list[Any]:
            return [direct_stream(stub, i, p, args.max_tokens) for i, p in enumerate(prompts)]

        def through() -> list[Any]:
            return [gateway_stream(http, url, p, args.max_tokens) for p in prompts]

        await run_round("warmup-direct", direct())
        await run_round("warmup-gateway", through())
        rounds = []
        for index in range(args.rounds):
            order = [("direct", direct), ("gateway", through)]
            for name, make in order if index % 2 == 0 else order[::-1]:
                rounds.append(await run_round(name, make()))
                common.log(
                    f"round {index} {name}: {rounds[-1]['tokens_per_s']} tok/s, ttft p50 {rounds[-1]['ttft_p50_ms']} ms"
                )
    reference = next(r["_tokens"] for r in rounds if r["path"] == "direct")
    differing = sorted({i for r in rounds for i, tokens in enumerate(r["_tokens"]) if tokens != reference[i]})
    for r in rounds:
        del r["_tokens"]
    by_path = {p: [r for r in rounds if r["path"] == p] for p in ("direct", "gateway")}
    tps = {p: statistics.median(r["tokens_per_s"] for r in rs) for p, rs in by_path.items()}
    ttft = {p: statistics.median(r["ttft_p50_ms"] for r in rs) for p, rs in by_path.items()}
    return {
        "rounds": rounds,
        "tokens_per_s": tps,
        "throughput_ratio": round(tps["gateway"] / tps["direct"], 4),
        "ttft_p50_ms": ttft,
        "ttft_p50_overhead_ms": round(ttft["gateway"] - ttft["direct"], 2),
        "streams_with_tokens_differing_from_direct": differing,
        "bars": {"throughput_ratio_min": 0.95, "ttft_p50_overhead_ms_max": 5.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per path, alternating which goes first")
    parser.add_argument("--k", type=int, default=3, help="EAGLE drafts per step")
    parser.add_argument("--out", type=Path, default=common.REPO / "bench" / "results")
    args = parser.parse_args()
    shape = common.PRESETS[args.preset]
    args.vocab = shape["vocab"]
    device = torch.device(args.device)
    dtype = common_pb2.DTYPE_FLOAT32 if device.type == "cpu" else common_pb2.DTYPE_BFLOAT16
    with tempfile.TemporaryDirectory() as workdir:
        load = Path(workdir) / "load.json"
        load.write_text(json_format.MessageToJson(common.synthetic_eagle_load(shape, args.k, dtype, 2048)))
        executor = start_server("executor", Path(workdir), "--device", args.device, "--load", str(load))
        gateway = None
        try:
            asyncio.run(wait_serving(executor.address))
            gateway = start_server(
                "gateway", Path(workdir), "--executor", executor.address, "--served-model-name", "bench"
            )
            measured = asyncio.run(measure(args, executor, gateway))
        finally:
            statuses = {"gateway": gateway.stop() if gateway else None, "executor": executor.stop()}
    report = {
        **common.provenance("gateway", device),
        "versions": common.versions(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {"preset": args.preset, **shape, "drafter": f"synthetic EAGLE, 1 layer, k = {args.k}"},
        **measured,
        "exit_statuses": statuses,
    }
    common.log(
        json.dumps({k: report[k] for k in ("tokens_per_s", "throughput_ratio", "ttft_p50_ms", "ttft_p50_overhead_ms")})
    )
    common.write_result(args.out, "gateway", device, report["commit"], report)


if __name__ == "__main__":
    main()

"""One rank of the all-reduce check (test_all_reduce_gpu.py): `--rank R --world N --init tcp://...` joins the
group through init_tensor_parallel (SPECDEC_TP_ALL_REDUCE from the environment), then all-reduces chains of
tensors eagerly and inside a CUDA graph, at sizes on both sides of each limit (one-shot, two-shot, NCCL), and rank
0 prints JSON: what the all-reduces used, and per case whether the results equal a reference sum of the ranks'
inputs computed on every rank in rank order. Then the all-reduce fused with the residual add and RMSNorm
(fused_all_reduce.py; SPECDEC_TP_ALL_REDUCE auto: the flags, push: the pushed rows) over 1 to 32 rows, a pass of
calls at a time, eagerly and in a graph: its stream must equal add_rms_norm's of the exact sum, its norm be close."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from executor_service.models.fused_ops import add_rms_norm
from executor_service.parallel.all_reduce import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, all_reduce
from executor_service.parallel.fused_all_reduce import all_reduce_add_rms_norm, begin_pass
from executor_service.parallel.state import destroy_tensor_parallel, init_tensor_parallel

CHAIN = 6  # dependent all-reduces in a row: a rank refilling the buffer while a peer reads it would show
WIDTH = 4096  # the fused cases' hidden size (the 8B shape's)


def inputs(rank: int, numel: int, dtype: torch.dtype, device: torch.device, round_: int) -> torch.Tensor:
    """What rank `rank` contributes: small integers, exact in every float dtype, so any sum order agrees."""
    generator = torch.Generator(device="cpu").manual_seed(1000 * round_ + rank)
    return torch.randint(-8, 9, (numel,), generator=generator).to(device=device, dtype=dtype)


def chain(x: torch.Tensor) -> torch.Tensor:
    """CHAIN all-reduces, each of the last one's output halved (still exact)."""
    for _ in range(CHAIN):
        x = all_reduce(x) * 0.5
    return x


def expected(world: int, numel: int, dtype: torch.dtype, device: torch.device, round_: int) -> torch.Tensor:
    total = sum(inputs(r, numel, dtype, device, round_).double() for r in range(world))
    for _ in range(CHAIN - 1):
        total = total * world * 0.5
    return (total * 0.5).to(dtype)


def fused_pass(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    """One pass's fused calls (their slices rotate from the pass's start): each call's normed and stream."""
    begin_pass()
    out: list[torch.Tensor] = []
    for x in xs:
        out.extend(all_reduce_add_rms_norm(x, residual, weight, 1e-6))
    return out


def partial(rank: int, rows: int, call: int, dtype: torch.dtype, device: torch.device, round_: int) -> torch.Tensor:
    """Rank `rank`'s partial sum for a pass's call `call`, with a -0.0 in it: a pushed buffer's empty mark, which
    the kernel must send as +0.0 (or its peers would wait forever)."""
    x = inputs(rank, rows * WIDTH, dtype, device, 10 * round_ + call).view(rows, WIDTH)
    x[0, call] = -0.0
    return x


def fused_case(world: int, rank: int, rows: int, dtype: torch.dtype, device: torch.device, round_: int) -> tuple:
    """(this rank's partials of a pass's CHAIN calls, residual, weight, the expected normed and streams)."""
    xs = [partial(rank, rows, c, dtype, device, round_) for c in range(CHAIN)]
    residual = inputs(world, rows * WIDTH, dtype, device, 10 * round_ + 9).view(rows, WIDTH)
    weight = torch.linspace(0.5, 1.5, WIDTH, device=device, dtype=dtype)
    want: list[torch.Tensor] = []
    for c in range(CHAIN):
        total = sum(partial(r, rows, c, dtype, device, round_).double() for r in range(world))
        want.extend(add_rms_norm(total.to(dtype), residual, weight, 1e-6))
    return xs, residual, weight, want


def same(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """The streams equal, the norms close (the fused kernel rounds as add_rms_norm does)."""
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    streams = all(torch.equal(g, w) for g, w in zip(got[1::2], want[1::2], strict=True))
    normed = all(torch.allclose(g, w, rtol=tolerance, atol=tolerance) for g, w in zip(got[::2], want[::2], strict=True))
    return streams and normed


def fused_cases(world: int, rank: int, device: torch.device, results: dict[str, bool]) -> None:
    """The fused all-reduce + norm against add_rms_norm of the exact sum, eagerly and replayed in a graph."""
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 4, 8, 32):  # past 8 rows only the pushed kernel fuses
            xs, residual, weight, want = fused_case(world, rank, rows, dtype, device, 0)
            results[f"fused eager {dtype} {rows}"] = same(fused_pass(xs, residual, weight), want, dtype)
            static, static_residual = [torch.zeros_like(x) for x in xs], torch.zeros_like(residual)
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                fused_pass(static, static_residual, weight)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused_pass(static, static_residual, weight)
            for round_ in (1, 2, 3):
                xs, residual, _, want = fused_case(world, rank, rows, dtype, device, round_)
                for target, x in zip(static, xs, strict=True):
                    target.copy_(x)
                static_residual.copy_(residual)
                graph.replay()
                results[f"fused graph {dtype} {rows} #{round_}"] = same(out, want, dtype)
            del graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", args.rank)
    group = init_tensor_parallel(args.rank, args.world, args.init, device)
    results: dict[str, bool] = {}
    for dtype in (torch.bfloat16, torch.float32):
        # one-shot; around its limit at 4 and at 2 ranks; two-shot and an unaligned size past one-shot (NCCL);
        # two-shot's limit and one past it (NCCL)
        limits = [ONE_SHOT_MAX_BYTES, 2 * ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES]
        sizes = [8, 4096, 32 * 4096] + [n // dtype.itemsize + d for n in limits for d in (0, 8)]
        sizes.append(2 * ONE_SHOT_MAX_BYTES // dtype.itemsize + 1)
        for numel in sizes:
            x = inputs(args.rank, numel, dtype, device, 0)
            results[f"eager {dtype} {numel}"] = torch.equal(chain(x), expected(args.world, numel, dtype, device, 0))
            static = torch.zeros_like(x)
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                chain(static)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(static)
            for round_ in (1, 2, 3):  # replays of new inputs
                static.copy_(inputs(args.rank, numel, dtype, device, round_))
                graph.replay()
                good = torch.equal(out, expected(args.world, numel, dtype, device, round_))
                results[f"graph {dtype} {numel} #{round_}"] = good
            del graph
    fused_cases(args.world, args.rank, device, results)
    torch.cuda.synchronize()
    if args.rank == 0:
        print(json.dumps({"all_reduce": group.all_reduce, "results": results}), flush=True)
    destroy_tensor_parallel()


if __name__ == "__main__":
    main()

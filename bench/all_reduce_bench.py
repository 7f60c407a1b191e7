"""All-reduce choices for tensor parallelism, timed inside CUDA graphs on 2 or more GPUs: NCCL, PyTorch's one-shot
and two-shot all-reduces over symmetric memory, at the sizes a decode step (batch x hidden) and a verify step
(batch x rows x hidden) all-reduce. Each choice's per-call time is one graph of CALLS all-reduces replayed,
median of the replays; every result is checked exactly against the expected sum (integer-valued inputs).

    python bench/all_reduce_bench.py --world 2 --out bench/results

Rank 0 writes all_reduce_<date>_<device>_w<world>.json; what parallel/all_reduce.py picks per size comes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES_KIB = (8, 32, 128, 256, 512, 1024, 2048, 4096, 8192)
CALLS = 32  # all-reduces per captured graph
REPLAYS = 20
METHODS = ("nccl", "one-shot", "two-shot")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    """Every rank as a process of this script; rank 0's report is the last line of its stdout."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--world", str(args.world), "--init", init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(args.world)
    ]
    try:
        outputs = [rank.communicate(timeout=args.timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for r, (rank, (_, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        if rank.returncode != 0:
            print(f"rank {r} failed:\n{stderr[-4000:]}", file=sys.stderr)
            return 1
    report = json.loads(outputs[0][0].strip().splitlines()[-1])
    report["commit"] = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or None
    args.out.mkdir(parents=True, exist_ok=True)
    device = report["device"].lower().replace("nvidia ", "").replace(" ", "-")
    path = args.out / f"all_reduce_{time.strftime('%Y-%m-%d')}_{device}_w{args.world}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for size, row in report["per_call_us"].items():
        print(f"{size:>8} KiB  " + "  ".join(f"{m} {row.get(m)}" for m in METHODS))
    print(f"wrote {path}")
    return 0


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(args.rank)
    dist.init_process_group("nccl", init_method=args.init, rank=args.rank, world_size=args.world)
    group = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    max_numel = max(SIZES_KIB) * 1024 // dtype.itemsize
    buffer = symm_mem.empty(max_numel, dtype=dtype, device="cuda")
    symm_mem.rendezvous(buffer, group)

    def run(method: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if method == "nccl":
            out.copy_(x)
            dist.all_reduce(out)
        elif method == "one-shot":
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[: x.numel()], x, "sum", group, out)
        else:
            staged = buffer[: x.numel()]
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group, out)
        return out

    per_call: dict[str, dict[str, float | str]] = {}
    stream = torch.cuda.Stream()
    for kib in SIZES_KIB:
        numel = kib * 1024 // dtype.itemsize
        # integers small enough that bf16 sums are exact: rank r holds (i mod 7) + r
        x = (torch.arange(numel, device="cuda") % 7 + args.rank).to(dtype)
        expected = (torch.arange(numel, device="cuda") % 7 * args.world + sum(range(args.world))).to(dtype)
        row: dict[str, float | str] = {}
        for method in METHODS:
            out = torch.empty_like(x)
            try:
                run(method, x, out)  # eager first: NCCL's communicator set up outside the capture
                torch.cuda.synchronize()
                exact = bool(torch.equal(out, expected))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.graph(graph, stream=stream):
                        for _ in range(CALLS):
                            run(method, x, out)
                torch.cuda.synchronize()
                times = []
                for _ in range(REPLAYS):
                    dist.barrier()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / CALLS)
                exact = exact and bool(torch.equal(out, expected))
                row[method] = round(statistics.median(times), 2) if exact else "wrong sums"
                del graph
            except Exception as err:  # a choice this torch or host does not have
                row[method] = f"{type(err).__name__}: {str(err)[:160]}"
            torch.cuda.synchronize()
            dist.barrier()
        per_call[str(kib)] = row
    if args.rank == 0:
        report = {
            "benchmark": "all_reduce",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": torch.cuda.get_device_name(0),
            "world": args.world,
            "versions": {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
            "dtype": "bfloat16",
            "calls_per_graph": CALLS,
            "replays": REPLAYS,
            "per_call_us": per_call,
        }
        print(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is None:
        return launch(args)
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

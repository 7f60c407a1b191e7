"""One rank of test_fused_all_reduce.py's two-rank cases: maps both ranks' buffers and flags from files (shared
memory, as symmetric memory maps peers' buffers on GPUs), runs the fused kernel's calls under the Triton
interpreter (flags, or --push) and saves what it wrote to DIR/rank_R.pt."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [str(Path(__file__).resolve().parents[3]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from fused_all_reduce_cases import CALLS, FLAGS, buffer_numel, inputs, launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--push", action="store_true")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    numel = buffer_numel(args.world, args.push)
    buffers = [
        torch.from_file(str(args.dir / f"buffer_{r}"), shared=True, size=numel, dtype=dtype) for r in range(args.world)
    ]
    flags = [
        torch.from_file(str(args.dir / f"flags_{r}"), shared=True, size=FLAGS * args.world, dtype=torch.int32)
        for r in range(args.world)
    ]
    out = []
    for call, slot in enumerate(CALLS):
        x, residual, weight = inputs(args.rank, call, dtype)
        residual = residual if call % 2 == 0 else None
        out.append(launch(x, residual, weight, buffers, flags, args.rank, args.world, slot, args.push))
    torch.save(out, args.dir / f"rank_{args.rank}.pt")


if __name__ == "__main__":
    main()

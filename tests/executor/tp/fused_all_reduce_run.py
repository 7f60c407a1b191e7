"""One rank of test_fused_all_reduce.py's two-rank case: maps both ranks' buffers and flags from files (shared
memory, as symmetric memory maps peers' buffers on GPUs), runs the fused kernel's calls under the Triton
interpreter and saves what it wrote to DIR/rank_R.pt."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [str(Path(__file__).resolve().parents[3]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from fused_all_reduce_cases import CALLS, FLAGS, NUMEL, inputs, launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    buffers = [torch.from_file(str(args.dir / f"buffer_{r}"), shared=True, size=NUMEL) for r in range(args.world)]
    flags = [
        torch.from_file(str(args.dir / f"flags_{r}"), shared=True, size=FLAGS * args.world, dtype=torch.int32)
        for r in range(args.world)
    ]
    out = []
    for call, slot in enumerate(CALLS):
        x, residual, weight = inputs(args.rank, call)
        out.append(launch(x, residual if call % 2 == 0 else None, weight, buffers, flags, args.rank, args.world, slot))
    torch.save(out, args.dir / f"rank_{args.rank}.pt")


if __name__ == "__main__":
    main()

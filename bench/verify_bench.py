"""Sampled verification: one verify step of sampled requests with drafts (host_verify.verify_on_host: the one
verifier over the batch, one host copy) against the same requests verified one at a time (verify_on_host with a
batch of one: a pass and a host copy per request). Random bf16 logits of the preset's vocabulary; each request k
drafts, half of them seeded; the settings cycle through temperature only, top-p, top-k with min-p, and
penalties. Reported per batch size: the median ms of a step each way and their ratio.

    python bench/verify_bench.py --out bench/results             # H100: Llama-3-8B's vocabulary, k = 3
    python bench/verify_bench.py --tiny --out /tmp                # a CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, commit_id, log, time_graph, versions, write_result  # noqa: E402

from executor_service.engine.request import Request  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.spec_decode.host_verify import verify_on_host  # noqa: E402

SETTINGS = [
    SamplingSettings(0.8),
    SamplingSettings(0.7, top_p=0.9),
    SamplingSettings(1.0, top_k=50, min_p=0.05),
    SamplingSettings(0.9, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3),
]


def one_at_a_time(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list:
    """Each request verified alone: its own pass over its rows and its own host copy."""
    found, row = [], 0
    for request, request_drafts in zip(requests, drafts, strict=True):
        rows = len(request_drafts) + 1
        found += verify_on_host(logits[row : row + rows], [request], [request_drafts])
        row += rows
    return found


def measure(batch: int, k: int, vocab: int, device: torch.device, iters: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch * (k + 1), vocab, generator=generator) * 3).to(device, torch.bfloat16)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(batch)]
    settings = [SamplingSettings(**{**s.__dict__, "seed": i if i % 2 else None}) for i, s in enumerate(settings)]
    drafts = [torch.randint(vocab, (k,), generator=generator).tolist() for _ in range(batch)]
    prompts = [torch.randint(vocab, (64,), generator=generator).tolist() for _ in range(batch)]
    requests = [Request(f"r{i}", prompts[i], s, 16, frozenset(), lambda _: None) for i, s in enumerate(settings)]
    batched = time_graph(lambda: verify_on_host(logits, requests, drafts), device, iters, 2)
    alone = time_graph(lambda: one_at_a_time(logits, requests, drafts), device, iters, 2)
    log(f"batch {batch:4d}: batched {batched:8.2f} ms, one at a time {alone:8.2f} ms ({alone / batched:.1f}x)")
    return {"batch": batch, "batched_ms": batched, "one_at_a_time_ms": alone, "speedup": alone / batched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="16,64,256,512")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny vocabulary, small batches: a smoke run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.batches, args.iters = "tiny", "4,16", 3
    device, vocab = torch.device(args.device), PRESETS[args.preset]["vocab"]
    commit, dirty = commit_id()
    log(f"verify bench: {args.preset} vocabulary {vocab}, k = {args.k}, {device}")
    rows = [measure(int(b), args.k, vocab, device, args.iters) for b in args.batches.split(",")]
    report = {"bench": "verify", "commit": commit, "dirty": dirty, "versions": versions(), "preset": args.preset,
              "vocab": vocab, "k": args.k, "device": str(device), "results": rows}  # fmt: skip
    write_result(args.out, "verify", device, commit, report)


if __name__ == "__main__":
    main()

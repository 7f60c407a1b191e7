"""Sampled verification: one verify step of sampled requests with drafts (rejection_sampler.verify_batch, one
batched pass and one host copy) against the same requests verified one at a time (target_probs and
rejection_sample per request: a softmax, a draw and a host copy each, as the engine did before the batched
pass). Random bf16 logits of the preset's vocabulary; each request k drafts, half of them seeded; the settings
cycle through temperature only, top-p, top-k with min-p, and penalties. Reported per batch size: the
median ms of a step each way and their ratio.

    python bench/verify_bench.py --out bench/results             # H100: Llama-3-8B's vocabulary, k = 3
    python bench/verify_bench.py --tiny --out /tmp                # a CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import PRESETS, commit_id, log, time_graph, versions, write_result  # noqa: E402

from executor_service.penalties import TokenCounts, penalised_logits  # noqa: E402
from executor_service.rejection_sampler import rejection_sample, verify_batch  # noqa: E402
from executor_service.sampling import SamplingSettings, make_generator, target_probs, to_host  # noqa: E402

SETTINGS = [
    SamplingSettings(0.8),
    SamplingSettings(0.7, top_p=0.9),
    SamplingSettings(1.0, top_k=50, min_p=0.05),
    SamplingSettings(0.9, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3),
]


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    token_counts: TokenCounts | None = None


def one_at_a_time(logits: torch.Tensor, settings: list[SamplingSettings], generators: list, drafts: list,
                  histories: list[History]) -> list[list[int]]:  # fmt: skip
    """The per-request verification the engine ran before the batched pass: the argmax and finite check of
    every row and the penalties in one pass with one host copy, then each request's own softmax, draw and copy."""
    argmax = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(-1, argmax[:, None])[:, 0])
    processed = penalised_logits(logits, settings, histories, drafts)
    to_host(torch.cat([processed.argmax(dim=-1), finite.long()]))
    emitted, row = [], 0
    for setting, generator, request_drafts in zip(settings, generators, drafts, strict=True):
        rows = len(request_drafts) + 1
        probs = target_probs(processed[row : row + rows], setting)
        tokens = torch.tensor(request_drafts, dtype=torch.int64, device=logits.device)
        emitted.append(rejection_sample(tokens, None, probs, generator))
        row += rows
    return emitted


def measure(batch: int, k: int, vocab: int, device: torch.device, iters: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch * (k + 1), vocab, generator=generator) * 3).to(device, torch.bfloat16)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(batch)]
    settings = [SamplingSettings(**{**s.__dict__, "seed": i if i % 2 else None}) for i, s in enumerate(settings)]
    drafts = [torch.randint(vocab, (k,), generator=generator).tolist() for _ in range(batch)]
    histories = [History(torch.randint(vocab, (64,), generator=generator).tolist()) for _ in range(batch)]
    generators = [make_generator(s, device) for s in settings]
    batched = time_graph(lambda: verify_batch(logits, settings, generators, drafts, histories), device, iters, 2)
    alone = time_graph(lambda: one_at_a_time(logits, settings, generators, drafts, histories), device, iters, 2)
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

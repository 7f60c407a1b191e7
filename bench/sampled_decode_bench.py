#!/usr/bin/env python
"""Target-only decoding, greedy against sampled, penalised and logprob requests (GPU; not a test): what the draw
costs a decode step, replayed as a CUDA graph (engine/sampler_graphs.py), launched op by op, and with every step
serial (as penalised and logprob requests decoded before they overlapped).

A synthetic target of a preset's shape (default SmolLM2-135M, whose batch-1 step is short enough for the host's
sampling launches to decide the pace), CUDA graphs on, every request generating --tokens tokens (EOS ignored), at
each --batches size: greedy; T = 0.7; T = 0.7 with top-p 0.9 (the sorted variant); greedy with a repetition and a
frequency penalty; greedy with logprobs = 5. Rounds are interleaved, medians and spreads reported, with each run's
tokens/s as a share of the same round's greedy run.

    python bench/sampled_decode_bench.py --out bench/results
    python bench/sampled_decode_bench.py --device cpu --batches 2 --tokens 4 --repeats 1 --out /tmp   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

import torch
from common import PRESETS, default_dtype, log, make_prompts, median, provenance, synthetic_target, write_result

from executor_service.engine.overlap_decode import DecodeOverlap
from executor_service.engine.request import RequestOutput
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.wire import resolve_target
from specdec.v1 import common_pb2, executor_pb2

MIXES = {
    "greedy": SamplingSettings(),
    "T0.7": SamplingSettings(0.7),
    "T0.7_top_p0.9": SamplingSettings(0.7, top_p=0.9),
    "penalised": SamplingSettings(repetition_penalty=1.2, frequency_penalty=0.3),  # greedy, the penalty table's
    "logprobs5": SamplingSettings(logprobs=5),  # greedy, the emitted token's and the top 5 logprobs read back
}
# The draw as one graph replay; op by op (DecodeOverlap._sampler off); every step serially (the overlap off: how
# penalised and logprob requests decoded before they overlapped).
MODES = ("graph", "eager", "serial")


def open_target(preset: str, batches: list[int], device: torch.device) -> ModelSession:
    backend = "TRITON_ATTN" if device.type == "cuda" else "CPU_ATTN"
    request = executor_pb2.LoadModelRequest(dtype=default_dtype(device), block_size=16, num_kv_blocks=4096)
    request.enable_prefix_caching = False
    request.target.synthetic.CopyFrom(synthetic_target(PRESETS[preset], 0))
    request.attention.backend = backend
    source = resolve_target(request.target, None, "target")
    settings = EngineSettings(max_num_batched_tokens=8192, max_num_seqs=max(batches), cuda_graphs=True)
    decision = common_pb2.BackendDecision(backend=backend)
    return build_session(source, request, decision, device, settings, start=False)


def run(session: ModelSession, prompts: list[list[int]], settings: SamplingSettings, tokens: int) -> float:
    """Tokens/s of the prompts decoded together, `tokens` each (EOS ignored)."""
    outputs: list[RequestOutput] = []
    for i, prompt in enumerate(prompts):
        request = session.new_request(f"r{i}", prompt, settings, tokens, outputs.append)
        request.eos_token_ids = frozenset()
        session.engine.add(request)
    started = time.perf_counter()
    session.engine.run_until_idle()
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2", choices=sorted(PRESETS))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda (the figures), or cpu (a smoke run of the script)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    session = open_target(args.preset, batches, device)
    vocab = PRESETS[args.preset]["vocab"]
    original = DecodeOverlap._sampler
    report: dict[str, Any] = provenance("sampled_decode", device) | {"preset": args.preset, "tokens": args.tokens}
    for batch in batches:
        prompts = make_prompts(batch, args.prompt_len, vocab, batch)
        rates: dict[str, list[float]] = defaultdict(list)
        for round_index in range(args.repeats + 1):  # round 0: untimed (compiles, captures)
            for mode in MODES:
                DecodeOverlap._sampler = original if mode != "eager" else lambda self, logits: None  # type: ignore
                session.engine.overlap_decode = mode != "serial"
                for name, settings in MIXES.items():
                    if name == "greedy" and mode != "graph":
                        continue  # greedy draws nothing; its serial rate is executor_bench's decode1
                    rate = run(session, prompts, settings, args.tokens)
                    if round_index:
                        rates[name if name == "greedy" else f"{name}_{mode}"].append(rate)
        DecodeOverlap._sampler = original  # type: ignore[method-assign]
        session.engine.overlap_decode = True
        greedy = rates["greedy"]
        section = {}
        for name, values in rates.items():
            shares = [v / g for v, g in zip(values, greedy, strict=True)]
            section[name] = {"tokens_per_s": median(values), "runs": values, "of_greedy": round(median(shares), 3)}
        report[f"batch_{batch}"] = section
        log(f"batch {batch}: " + ", ".join(f"{n} {s['tokens_per_s']:.0f} tok/s ({s['of_greedy']}x greedy)"
                                           for n, s in section.items()))  # fmt: skip
    session.shutdown()
    write_result(Path(args.out), "sampled_decode", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

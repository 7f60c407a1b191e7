"""Pool gateway_bench.py results by configuration: the time to first token overhead over every round of every run.

One run's overhead is the median of its per-round differences (gateway p50 - direct p50), and at 64 streams a
round's p50 jumps by an engine step (tens of ms) with the order requests reached the executor, so on a loaded host
one run of 8 or 16 rounds says little. This pools the rounds of several runs of one configuration (the "label" key
of each file, else its gateway flags): the median of the per-round differences with a bootstrap 95% interval, the
share of rounds over the bar's +5 ms, a lone stream's overhead, the throughput ratio, the gateway's CPU a round and
the stand-in arrivals (median request, ms after the start, gateway / direct).

    python bench/gateway_pool.py bench/results/gateway_2026-11-28_cpu_{3fd74e3,765540a}_*
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
from pathlib import Path
from typing import Any


def pooled(reports: list[dict[str, Any]], resamples: int = 2000) -> dict[str, Any]:
    overheads = [x for r in reports for x in r["ttft_p50_overhead_ms_per_round"]["values"]]
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(overheads, k=len(overheads))) for _ in range(resamples))
    arrivals = {
        path: [
            x["median_ms"]
            for r in reports
            for x in r.get("stand_in_arrivals", {}).get("arrival_rounds", {}).get(path, [])
        ]
        for path in ("gateway", "direct")
    }
    gateway_cpu = [x["cpu_s"]["gateway"] for r in reports for x in r["rounds"] if x["path"] == "gateway"]
    return {
        "runs": len(reports),
        "rounds": len(overheads),
        "ttft_p50_overhead_ms": round(statistics.median(overheads), 1),
        "ttft_p50_overhead_ms_95": [round(boots[int(0.025 * resamples)], 1), round(boots[int(0.975 * resamples)], 1)],
        "rounds_over_5_ms": round(sum(x > 5 for x in overheads) / len(overheads), 2),
        "lone_stream_overhead_ms": round(
            statistics.median(r["single_stream_ttft_ms"]["overhead"]["median"] for r in reports), 2
        ),
        "throughput_ratio": round(statistics.median(r["throughput_ratio"] for r in reports), 3),
        "throughput_ratio_per_round": round(
            statistics.median(x for r in reports for x in r["throughput_ratio_per_round"]["values"]), 3
        ),
        "gateway_cpu_s_a_round": round(statistics.median(gateway_cpu), 3),
        "stand_in_arrival_median_ms": {p: round(statistics.median(v), 1) for p, v in arrivals.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for path in args.files:
        report = json.loads(path.read_text())
        groups[report.get("label") or report["settings"].get("gateway_args") or "default"].append(report)
    for label, reports in sorted(groups.items()):
        print(json.dumps({"label": label, **pooled(reports)}))


if __name__ == "__main__":
    main()

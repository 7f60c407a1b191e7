#!/usr/bin/env python
"""Which rank reaches each collective last, and why: the ranks' kernel timelines lined up (not a test).

`bench/tp_bench.py` with SPECDEC_TP_TIMELINE_DIR set leaves each rank's profiled kernels there
(timeline_rank<r>.json: name, start on the host's clock, duration; rank_profile.py). Every rank runs the same
collectives in the same order, so the i-th collective of each rank is one meeting: the rank that starts it last
makes the others wait, and a collective's time on a rank (its kernel's duration) is mostly that wait. Per rank
this prints how late it arrives (start minus the earliest rank's start), the idle time on its GPU before it
(the gap after the kernel before: host launches, dependencies), and its work between two meetings (the other
kernels' time), per step (a step: one of the graph's input broadcasts to the next), from the second step on (the
profile starts on rank 0 first).

    python bench/tp_timeline.py DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.parallel.rank_profile import is_collective

Kernel = tuple[str, float, float]  # name, start (us), duration (us)


def load(folder: Path) -> dict[int, list[Kernel]]:
    ranks = {}
    for path in sorted(folder.glob("timeline_rank*.json")):
        ranks[int(path.stem.removeprefix("timeline_rank"))] = [tuple(k) for k in json.loads(path.read_text())]
    return ranks


def meetings(kernels: list[Kernel]) -> list[tuple[int, Kernel]]:
    """(index in the timeline, kernel) of each collective, in order."""
    return [(i, k) for i, k in enumerate(kernels) if is_collective(k[0])]


def analyse(ranks: dict[int, list[Kernel]]) -> dict:
    met = {r: meetings(kernels) for r, kernels in ranks.items()}
    count = min(len(m) for m in met.values())
    names_agree = all(met[r][i][1][0] == met[0][i][1][0] for r in met for i in range(count))
    # The profile starts on rank 0 first, so the first step's broadcast holds a follower's wait for it: steady
    # state starts at the second step's broadcast.
    starts = [i for i in range(count) if "Broadcast" in met[0][i][1][0]]
    first = starts[1] if len(starts) > 2 else 0
    late: dict[int, list[float]] = {r: [] for r in ranks}
    gap: dict[int, list[float]] = {r: [] for r in ranks}
    work: dict[int, list[float]] = {r: [] for r in ranks}
    last_counts = dict.fromkeys(ranks, 0)
    for i in range(first, count):
        arrivals = {r: met[r][i][1][1] for r in ranks}
        earliest = min(arrivals.values())
        last_counts[max(arrivals, key=arrivals.__getitem__)] += 1
        for r, kernels in ranks.items():
            index, kernel = met[r][i]
            late[r].append(arrivals[r] - earliest)
            if index > 0:
                before = kernels[index - 1]
                gap[r].append(max(0.0, kernel[1] - (before[1] + before[2])))
            if i > first:
                previous = met[r][i - 1][0]
                work[r].append(sum(k[2] for k in kernels[previous + 1 : index] if not is_collective(k[0])))
    steps = max(1, len(starts) - (1 if first else 0))
    report: dict = {"collectives": count - first, "steps": steps, "names_agree": names_agree, "ranks": {}}
    for r in sorted(ranks):
        collective_us = sum(met[r][i][1][2] for i in range(first, count))
        report["ranks"][r] = {
            "arrives_last": last_counts[r],
            "late_us_median": round(statistics.median(late[r]), 2),
            "late_us_per_step": round(sum(late[r]) / steps, 1),
            "gap_before_us_median": round(statistics.median(gap[r]), 2) if gap[r] else None,
            "gap_before_us_per_step": round(sum(gap[r]) / steps, 1),
            "work_between_us_median": round(statistics.median(work[r]), 2) if work[r] else None,
            "collective_us_per_step": round(collective_us / steps, 1),
            "kernels": len(ranks[r]),
        }
    worst = sorted(range(count - first), key=lambda j: -max(late[r][j] for r in ranks))[:8]
    report["latest_arrivals"] = [
        {
            "collective": first + j,
            "name": met[0][first + j][1][0][:40],
            "late_us": {r: round(late[r][j], 1) for r in ranks},
            "kernel_before": {r: ranks[r][met[r][first + j][0] - 1][0][:40] for r in ranks if met[r][first + j][0] > 0},
        }
        for j in worst
    ]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ranks = load(args.folder)
    if 0 not in ranks or len(ranks) < 2:
        raise SystemExit(f"{args.folder}: no timelines of rank 0 and a follower")
    report = analyse(ranks)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()

"""bench/tp_bench.py --tiny on the CPU (gloo): TP 1, 1g (a group of one rank) and 2 each in its own process,
target-only and EAGLE-3 with --drafts always-right (the target echoes on every rank, rank 0 drafts its newest
token); it writes its result file, the tokens at 1g and 2 equal TP 1's (fp32), EAGLE-3's equal target-only's at
each size with every draft accepted, and the speedups carry issue 33's bar. No timing is judged here."""

from __future__ import annotations

import json
from pathlib import Path

import tp_bench


def test_tiny_run_reports_each_size_equal_tokens_and_the_speedup_bar(tmp_path: Path) -> None:
    argv = ["--tiny", "--method", "eagle3", "--drafts", "always-right", "--batch", "2", "--decode-tokens", "17"]
    argv += ["--repeats", "1", "--tp-sizes", "1,1g,2", "--out", str(tmp_path)]
    assert tp_bench.main(argv) == 0
    (path,) = tmp_path.glob("tp_*_cpu_*.json")
    report = json.loads(path.read_text())
    workload = report["workload"]
    assert workload["method"] == "eagle3" and workload["drafts"] == "always-right" and workload["batch"] == 2
    assert sorted(report["tp"]) == ["1", "1g", "2"]
    for methods in report["tp"].values():
        assert sorted(methods) == ["eagle3", "none"]
        for figures in methods.values():
            assert figures["identical_to_first"] and figures["output_tokens_per_s"] > 0
            assert figures["replays"]["eager"] > 0 and "graph" not in figures["replays"]  # the CPU: eager
        assert methods["none"]["drafted"] == 0
        eagle3 = methods["eagle3"]  # k = 7: 8 tokens a verify step, every draft accepted
        assert eagle3["drafted"] > 0 and eagle3["accepted"] == eagle3["drafted"] == 7 * eagle3["verify_steps"]
        assert eagle3["mean_acceptance_length"] == 8.0 and eagle3["mismatched_requests"] == 0
    speedups = report["speedups"]
    assert sorted(speedups) == ["1", "1g", "2"] and "over_tp1" not in speedups["1"]["eagle3"]
    bar = speedups["2"]["eagle3"]
    assert bar["bar"] == 0.9 and bar["mismatched_requests"] == 0 and bar["mean_acceptance_length"] == 8.0
    assert bar["over_tp1"] > 0 and isinstance(bar["bar_met"], bool)
    profiled = report["tp"]["2"]["none"]["collectives"]  # rank 0's decode steps, and rank 1's own of the same
    follower = profiled["followers"]["1"]
    assert profiled["profiled_steps"] > 0 and follower["profiled_steps"] == profiled["profiled_steps"], profiled

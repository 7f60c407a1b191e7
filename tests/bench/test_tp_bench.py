"""bench/tp_bench.py --tiny on the CPU (gloo): TP 1, 1g (a group of one rank) and 2 each in its own process,
target-only (the drafters at TP 2 are tests/executor/tp's); it writes its result file and the tokens at 1g and 2
equal TP 1's (fp32). No timing is judged here."""

from __future__ import annotations

import json
from pathlib import Path

import tp_bench


def test_tiny_run_reports_each_size_and_equal_tokens(tmp_path: Path) -> None:
    argv = ["--tiny", "--method", "none", "--batch", "2", "--decode-tokens", "4", "--out", str(tmp_path)]
    argv += ["--tp-sizes", "1,1g,2"]
    assert tp_bench.main(argv) == 0
    (path,) = tmp_path.glob("tp_*_cpu_*.json")
    report = json.loads(path.read_text())
    assert report["workload"]["method"] == "none" and report["workload"]["batch"] == 2
    assert sorted(report["tp"]) == ["1", "1g", "2"]
    for methods in report["tp"].values():
        assert sorted(methods) == ["none"]
        for figures in methods.values():
            assert figures["identical_to_first"] and figures["output_tokens_per_s"] > 0
            assert figures["replays"]["eager"] > 0 and "graph" not in figures["replays"]  # the CPU: eager
    assert report["tp"]["2"]["none"]["drafted"] == 0
    profiled = report["tp"]["2"]["none"]["collectives"]  # rank 0's decode steps, and rank 1's own of the same
    follower = profiled["followers"]["1"]
    assert profiled["profiled_steps"] > 0 and follower["profiled_steps"] == profiled["profiled_steps"], profiled

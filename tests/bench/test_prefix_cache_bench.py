"""bench/prefix_cache_bench.py --tiny on the CPU: it runs, writes its result file, and reports what the GPU run
is read for (no timing is judged here: the figures mean nothing on a loaded CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import prefix_cache_bench
import pytest


def test_tiny_run_reports_hits_and_identical_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["prefix_cache_bench.py", "--tiny", "--repeats", "1", "--out", str(tmp_path)])
    assert prefix_cache_bench.main() == 0
    (path,) = tmp_path.glob("prefix_cache_*_cpu_*.json")
    report = json.loads(path.read_text())
    assert report["workload"]["requests"] == 4 and report["method"] == "none"
    assert report["outputs_identical"] and report["identical_requests"] == "4/4"
    (with_run,), (without_run,) = report["with_caching"]["runs"], report["without_caching"]["runs"]
    assert with_run["prefix_cache_queries"] == 4 * (64 + 8)
    assert with_run["prefix_cache_hits"] == 4 * 64 and report["prefix_cache_hit_rate"] == round(64 / 72, 4)
    assert without_run["prefix_cache_queries"] == 0
    assert report["ttft_ratio"] > 0 and report["with_caching"]["summary"]["ttft_median_ms"] > 0

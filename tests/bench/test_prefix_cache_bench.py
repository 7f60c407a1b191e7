"""bench/prefix_cache_bench.py --tiny on the CPU: it runs, writes its result file, and reports what the GPU run
is read for (no timing is judged here: the figures mean nothing on a loaded CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import prefix_cache_bench
import pytest
from prefix_cache_controls import verdict

from executor_service.engine.prefix_cache import PrefixCache
from executor_service.engine.request import Request


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
    assert report["divergences"] == [] and report["dtype"] == "float32"
    pinned = report["pinned"]  # one at a time, chunked at the cache boundary: the same arithmetic on both sides
    assert pinned["cache_boundary_tokens"] == 64 and pinned["requests_off_boundary"] == []
    assert pinned["identical_requests"] == "4/4" and pinned["outputs_identical"]
    assert pinned["logprobs"] == {"bit_identical_requests": "4/4", "max_abs_logprob_diff": 0.0}
    assert report["fp32"]["identical_requests"] == "4/4" and report["fp32"]["prefix_cache_hits"] == 4 * 64
    assert report["near_ties"]["probed"] == 0 and report["near_ties"]["typical_first_token_gap_median"] > 0
    assert report["identity_verdict"] == "identical"


def test_controls_catch_a_wrong_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caching bug (a wrong block: the second cached block also in the place of the first) shows in the
    pinned control, whose arithmetic is otherwise the same with and without caching: in every request's log
    probabilities, though the random target flips few tokens (so a near tie alone does not clear the caching).
    Each divergence is probed: the token without caching is among a plain prefill's top two. (Blocks merely out
    of order would not show: their keys carry their positions' rotary, and attention over a context is a sum in
    any order.)"""
    found = PrefixCache.computed_blocks

    def wrong_block(self: PrefixCache, request: Request) -> list[int]:
        blocks = found(self, request)
        return blocks[1:2] + blocks[1:]

    monkeypatch.setattr(PrefixCache, "computed_blocks", wrong_block)
    argv = ["prefix_cache_bench.py", "--tiny", "--repeats", "1", "--controls", "pinned,ties", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert prefix_cache_bench.main() == 0
    (path,) = tmp_path.glob("prefix_cache_*_cpu_*.json")
    report = json.loads(path.read_text())
    assert "fp32" not in report
    pinned = report["pinned"]
    assert pinned["requests_off_boundary"] == [] and pinned["logprobs"]["bit_identical_requests"] == "0/4"
    assert pinned["logprobs"]["max_abs_logprob_diff"] > 0
    probed = pinned["divergences"] + report["divergences"]
    assert all(entry["without"] in entry["top2"] for entry in probed)
    assert report["near_ties"]["probed"] == len(report["divergences"])
    assert report["identity_verdict"].startswith("caching logic suspect")


def test_verdict_names_where_a_difference_comes_from() -> None:
    pinned = {"outputs_identical": True, "logprobs": {"bit_identical_requests": "64/64"}}
    report = {"outputs_identical": False, "pinned": pinned, "fp32": {"outputs_identical": True}}
    assert verdict(report) == "bf16 rounding: the burst differs, the controls (pinned, fp32) do not"
    assert verdict({**report, "fp32": {"outputs_identical": False}}).startswith("fp32 burst differs")
    assert verdict({**report, "fp32": {"error": "OutOfMemoryError()"}}).endswith("the controls (pinned) do not")
    off = {"outputs_identical": True, "logprobs": {"bit_identical_requests": "63/64"}}
    assert verdict({**report, "pinned": off}).startswith("caching logic suspect")
    assert verdict({"outputs_identical": False}) == "burst differs; no control ran"

"""prefix_cache_bench.py's pinned control on CUDA (SmolLM2's shape, bf16, TRITON_ATTN, CUDA graphs, EAGLE-3 and
DFlash): with the arithmetic pinned (requests one at a time, chunked at the cache boundary) caching on and off
must give the same tokens and the same log probabilities to the bit, in bf16. A failure here is the caching
logic on the GPU path (a wrong or stale block, positions, the drafter's cache), not rounding. The burst's own
identity is reported, not judged: bf16 rounds differently there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import prefix_cache_bench
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def pinned_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, backend: str, method: str) -> dict:
    """The bench at a small scale with the pinned and near-tie controls; its report."""
    argv = [
        "prefix_cache_bench.py", "--preset", "smollm2", "--device", device, "--backend", backend, "--method", method,
        "--dtype", "bfloat16", "--system-tokens", "512", "--user-tokens", "40", "--requests", "8", "--repeats", "1",
        "--max-tokens", "12", "--controls", "pinned,ties", "--out", str(tmp_path),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert prefix_cache_bench.main() == 0
    (path,) = tmp_path.glob("prefix_cache_*.json")
    return json.loads(path.read_text())


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_pinned_control_is_bit_identical_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    report = pinned_report(tmp_path, monkeypatch, "cuda", "TRITON_ATTN", method)
    pinned = report["pinned"]
    boundary = 496 if method == "eagle3" else 512  # an EAGLE key holds the next block's first token
    assert pinned["cache_boundary_tokens"] == boundary and pinned["requests_off_boundary"] == []
    assert pinned["identical_requests"] == "8/8", pinned["divergences"]
    assert pinned["logprobs"] == {"bit_identical_requests": "8/8", "max_abs_logprob_diff": 0.0}
    assert report["prefix_cache_hit_rate"] > 0.8

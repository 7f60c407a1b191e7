"""specdec_bench's (d): the target echoes its newest token by a margin no rounding reaches, so the always-right
drafter stays right whatever k adaptive speculation takes (a random bf16 target's tokens change with the step's
shape: the H100 run of 2026-11-28 saw that drafter's acceptance fall to 0.012 under adaptive speculation), the
synthetic drafters stay wrong, and every run's tokens equal target-only's (CPU, tiny preset)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from common import PRESETS
from greedy_reference import dense_logits
from specdec_bench import WARM_UP_RUNS, measure_adaptive, open_sessions, parse_args, target_request

from executor_service.models.loader import build_synthetic
from executor_service.models.weights import echoing_target
from executor_service.server.wire import resolve_target

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_echoing_target_repeats_its_newest_token_by_a_wide_margin(tied: bool) -> None:
    config = resolve_target(target_request(TINY, 0, "", 0).target, None, "target").config
    config = replace(config, tie_word_embeddings=tied)
    model = build_synthetic(config, 0, torch.bfloat16, torch.device("cpu")).model
    prompt = [5, 900, 17, 3, 511, 64]
    before = dense_logits(model, prompt).float().topk(2).values
    echoing_target(model)
    logits = dense_logits(model, prompt).float()
    assert logits.argmax(-1).tolist() == prompt  # each position's next token: its own
    top = logits.topk(2).values
    margin = (top[:, 0] - top[:, 1]).min()
    assert margin > 5
    if not tied:  # a random untied target's greedy choices are near ties (a tied one's already echo, less widely)
        assert margin > 10 * (before[:, 0] - before[:, 1]).median()


def test_adaptive_runs_keep_target_only_tokens_and_full_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--preset", "tiny", "--device", "cpu", "--backend", "CPU_ATTN", "--e2e-methods", "eagle3"]
    argv += ["--adaptive-batches", "8", "--max-tokens", "24", "--repeats", "1", "--kv-blocks", "256"]
    monkeypatch.setattr(sys, "argv", ["specdec_bench.py", *argv])
    args = parse_args()
    sessions = open_sessions(args, TINY)
    try:
        entry = measure_adaptive(sessions, args, TINY)["batch_8"]
    finally:
        for session in sessions.values():
            session.shutdown()
    assert entry["target_only_mismatched_requests"] == 0
    runs = [name for name in entry if name.startswith("eagle3_") and name != "speculation"]
    assert len(runs) == 4 and all(entry[name]["mismatched_requests"] == 0 for name in runs)
    assert entry["eagle3_full_fixed_k"]["acceptance"] == [8.0]  # every draft accepted, the last steps' too
    speculation = entry["speculation"]
    assert speculation["eagle3_full"]["acceptance_per_depth"] == [1.0] * 7  # under adaptive k as well
    assert max(speculation["eagle3_synthetic_drafter"]["acceptance_per_depth"]) < 0.05  # still always wrong
    warm_ups = entry["adaptive_warm_up_runs"]  # untimed reruns until every candidate (0-7 here) was measured
    assert set(warm_ups) <= {"eagle3_synthetic_drafter_adaptive", "eagle3_full_adaptive"}
    assert all(1 < runs <= WARM_UP_RUNS for runs in warm_ups.values())

"""Tensor parallelism on the CPU (gloo): greedy tokens at TP 2 and 4 equal the single-process ones, token
for token, with no drafter and with the synthetic EAGLE-3 and DFlash drafters (rank 0's drafter reads the
sharded target's features and heads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_greedy_run import METHODS, PROMPTS, SIZES, greedy_outputs

from executor_service.config import ModelConfig
from executor_service.parallel.layers import vocab_shard
from executor_service.parallel.state import check_tensor_parallel_size, shard_violations

RUN = Path(__file__).with_name("tp_greedy_run.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, list[int]]]:
    return {method: greedy_outputs(method) for method in METHODS}


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_equals_single_process(tp: int, single_process: dict[str, dict[str, list[int]]]) -> None:
    run = subprocess.run(
        [sys.executable, str(RUN), "--tp", str(tp)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # N processes' thread pools on a 2-core machine
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = json.loads(run.stdout.strip().splitlines()[-1])
    for method in METHODS:
        assert outputs[method] == single_process[method], f"TP {tp}, drafter {method}"
    assert all(len(tokens) == 12 for tokens in single_process["none"].values()) and len(PROMPTS) == 3


def test_vocab_shards_cover_the_vocabulary_once() -> None:
    held = [vocab_shard(510, rank, 4) for rank in range(4)]
    assert held == [(0, 128, 128), (128, 128, 128), (256, 128, 128), (384, 126, 128)]
    assert sum(count for _, count, _ in held) == 510


def test_sizes_that_do_not_divide_are_refused_with_the_flag() -> None:
    config = ModelConfig(architecture="llama", **{**SIZES, "num_kv_heads": 2})
    assert shard_violations(config, 2, "target") == []
    violations = shard_violations(config, 4, "target")
    assert [v.field for v in violations] == ["target"]
    assert "2 KV heads do not divide by --tensor-parallel-size 4" in violations[0].description
    with pytest.raises(ValueError, match="--tensor-parallel-size must be between 1 and 64, not 0"):
        check_tensor_parallel_size(0)
    assert torch.distributed.is_available()

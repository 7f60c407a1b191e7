"""Tensor parallelism on the CPU (gloo): greedy tokens at TP 2 and 4 equal the single-process ones, token
for token, with no drafter and with the synthetic EAGLE-3 and DFlash drafters, chains and EAGLE-3 trees (static and
dynamic) verified on the device step (rank 0's drafter reads the sharded target's features and heads); and the
benchmarks' always-right configuration at TP 2 accepts every draft."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tp_greedy_run import ACCEPTANCE, MAX_TOKENS, METHODS, PROMPTS, REPLAYS, SIZES, K, greedy_outputs, write_checkpoint

from executor_service.models.config import ModelConfig
from executor_service.models.loader import LoadedModel, load_directory
from executor_service.models.model_loading import ECHOING_TARGET_ENV
from executor_service.parallel.layers import shard_model, vocab_shard
from executor_service.parallel.loading import load_target_shard
from executor_service.parallel.state import check_tensor_parallel_size
from executor_service.server.validation import shard_violations

RUN = Path(__file__).with_name("tp_greedy_run.py")
REPO = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, list[int]]]:
    return {method: greedy_outputs(method) for method in METHODS}


def run_tp(tp: int, *args: str) -> dict[str, dict[str, list[int]]]:
    return run_tp_with_replays(tp, *args)[0]


def run_tp_with_replays(tp: int, *args: str) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, int]]]:
    """Each method's tokens and graph replays (tp_greedy_run.graph_replays) at TP `tp`."""
    tokens, replays, _ = run_tp_printed(tp, *args)
    return tokens, replays


def run_tp_printed(tp: int, *args: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Each method's tokens, graph replays and acceptance (engine_driving.Outputs.acceptance) at TP `tp`; every
    rank stops with no graph held (NCCL's teardown waits on graphs that captured its collectives:
    launcher.release_graphs)."""
    run = subprocess.run(
        [sys.executable, str(RUN), "--tp", str(tp), *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # N processes' thread pools on a 2-core machine
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "still held at stop" not in run.stderr, run.stderr[-3000:]
    *_, accepted, replays, tokens = run.stdout.strip().splitlines()
    assert accepted.startswith(ACCEPTANCE) and replays.startswith(REPLAYS), run.stdout[-3000:]
    return json.loads(tokens), json.loads(replays.removeprefix(REPLAYS)), json.loads(accepted.removeprefix(ACCEPTANCE))


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_equals_single_process(tp: int, single_process: dict[str, dict[str, list[int]]]) -> None:
    outputs, replays = run_tp_with_replays(tp)
    for method in METHODS:
        assert outputs[method] == single_process[method], f"TP {tp}, drafter {method}"
    assert all(len(tokens) == 12 for tokens in single_process["none"].values()) and len(PROMPTS) == 3
    # Chains and the tree verify on the device step: the tree's accepted path moves K/V on every rank (MOVE_KV).
    assert all(replays[m]["engine device"] > 0 for m in METHODS if m != "none"), replays


def test_graphs_replay_in_lockstep(single_process: dict[str, dict[str, list[int]]]) -> None:
    """The target's graphs under TP 2 (the CPU's stand-ins, cuda_graphs.EagerReplay, which rerun the passes and
    their collectives): rank 0 sends each replay's bucket and static inputs, the follower replays the same
    graph from them. Decode steps and the speculative step replay graphs (after a finish too, for the requests
    still running), and the tokens are the eager ones; without a drafter, decode steps launch the step after them
    before their read-back (overlap_decode.py), graph replays and their lockstep included. A tree step's graphs
    also carry the tree's layout and the accepted path's K/V moves from rank 0 to the follower (a follower that
    skipped the moves gave other tokens here)."""
    methods = ("none", "eagle3", "dflash", "eagle3_tree", "eagle3_dynamic_tree")
    outputs, replays = run_tp_with_replays(2, "--graphs", "--methods", ",".join(methods))
    for method in methods:
        assert outputs[method] == single_process[method], f"drafter {method}"
    assert replays["none"]["graph"] > 0 and replays["none"]["engine overlapped decode"] > 0
    assert all(replays[m]["spec step graph"] + replays[m]["spec step graph following"] > 0 for m in methods[1:])
    # Requests finishing apart: the step launched after a finish went on for the others (PendingStep.narrowed).
    assert all(replays[m].get("spec step narrowed", 0) > 0 for m in methods[1:]), replays


def test_always_right_drafts_are_all_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/tp_bench.py --drafts always-right at TP 2, with the CPU's graphs: every rank's shard echoes (the
    target's next token is its newest: ECHOING_TARGET_ENV, set before the followers start), rank 0's EAGLE-3
    drafts that token (EchoDrafts, in the device step too, so steps launch ahead), and every draft is accepted
    (k + 1 tokens a verify step, the last steps' too); the tokens of both runs equal one process's target-only run.
    A follower that did not echo would give rank 0 other logits for its vocabulary's half."""
    monkeypatch.setenv(ECHOING_TARGET_ENV, "1")
    reference = greedy_outputs("none")  # one process, target-only
    assert reference == {f"r{i}": [prompt[-1]] * MAX_TOKENS for i, prompt in enumerate(PROMPTS)}  # it echoes
    outputs, replays, accepted = run_tp_printed(2, "--echo", "--graphs", "--methods", "none,eagle3")
    assert outputs == {"none": reference, "eagle3": reference}
    eagle3 = accepted["eagle3"]
    assert eagle3["drafted"] > 0 and eagle3["accepted"] == eagle3["drafted"] == K * eagle3["verify_steps"], eagle3
    assert replays["eagle3"]["spec step graph"] > 0  # the graphed speculative step, in lockstep
    assert replays["eagle3"]["spec step graph following"] > 0  # launched ahead: the echo is in the device step


def test_sharded_loading_from_a_checkpoint(tmp_path: Path) -> None:
    """Each rank reads only its slices of a Hugging Face checkpoint (rank 0 the whole heads for EAGLE-3): the
    same tokens as one process loading it whole. Qwen3 (q/k norms) with attention biases (o_proj's on rank 0
    only). Tied random embeddings make the target echo its last token whatever the other weights, so tying is
    covered by the exact-shard test below instead."""
    checkpoint = tmp_path / "target"
    write_checkpoint(checkpoint, "qwen3", tied=False, bias=True)
    single = {method: greedy_outputs(method, checkpoint=checkpoint) for method in ("none", "eagle3")}
    outputs = run_tp(2, "--checkpoint", str(checkpoint), "--methods", "none,eagle3")
    assert outputs == single
    assert single["none"] != greedy_outputs("none")  # the checkpoint's weights, not the synthetic target's


@pytest.mark.parametrize(("architecture", "tied", "bias"), [("llama", False, True), ("qwen3", True, False)])
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_reads_exactly_its_shard(
    architecture: str, tied: bool, bias: bool, world_size: int, tmp_path: Path
) -> None:
    """Every parameter a rank reads from the checkpoint equals the same shard cut from the whole model; the
    whole model is never built for it; rank 0's whole heads are the checkpoint's."""
    checkpoint = tmp_path / "target"
    write_checkpoint(checkpoint, architecture, tied, bias)
    whole = load_directory(checkpoint, torch.float32, CPU, "target.path").model

    def never() -> LoadedModel:
        raise AssertionError("a checkpoint is read in slices, never whole")

    for rank in range(world_size):
        loaded, heads = load_target_shard(checkpoint, never, torch.float32, CPU, rank, world_size, rank == 0)
        expected = shard_model(load_directory(checkpoint, torch.float32, CPU, "target.path").model, rank, world_size)
        got = dict(loaded.model.named_parameters(remove_duplicate=False))
        for name, parameter in expected.named_parameters(remove_duplicate=False):
            assert torch.equal(got[name], parameter), (rank, name)
        assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == tied
        if rank == 0:
            assert heads is not None and torch.equal(heads.embed_tokens.weight, whole.embed_tokens.weight)
            assert torch.equal(heads.lm_head.weight, whole.lm_head.weight)
        else:
            assert heads is None


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

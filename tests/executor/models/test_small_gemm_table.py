"""The fused-GEMM table's merge (a bench run replaces the shapes it timed and keeps the rest) and its trials."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kernels import small_gemm_table
from kernels.small_gemm_table import POLICY_ENV, GemmConfig, choose, device_name, merge_winners, trial_table


def test_merge_replaces_only_the_shapes_the_run_timed(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    old = {"linear:1:576:1536": {"block_n": 16}, "linear:16:576:1536": {"block_n": 32}, "qkv_rope:1:960:576": {}}
    path.write_text(json.dumps({"about": "kept", "devices": {"GPU": {"bfloat16": old}, "Other": {"bfloat16": old}}}))
    gemv = asdict(GemmConfig(8, 1024, 4, gemv=True))
    measured = {"bfloat16": {"linear:1:576:1536", "qkv_rope:1:960:576", "gate_up_silu:1:3072:576"}}
    merge_winners({"bfloat16": {"gate_up_silu:1:3072:576": gemv}}, "GPU", measured, path)
    document = json.loads(path.read_text())
    assert document["about"] == "kept"
    assert document["devices"]["GPU"]["bfloat16"] == {
        "gate_up_silu:1:3072:576": gemv,  # won this time
        "linear:16:576:1536": {"block_n": 32},  # not timed: kept
    }  # linear:1 and qkv_rope:1 lost this time: gone
    assert document["devices"]["Other"]["bfloat16"] == old
    assert GemmConfig(**document["devices"]["GPU"]["bfloat16"]["gate_up_silu:1:3072:576"]).gemv


def test_a_trial_table_replaces_the_file_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's step-level trials: `choose` reads the trial's entries, and the file's again after it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(POLICY_ENV, "table")
    cpu = torch.device("cpu")
    config = GemmConfig(16, 256, 4)
    trial = {"cpu": {"float32": {"linear:8:64:32": asdict(config)}}}
    assert choose("linear", 8, 64, 32, torch.float32, cpu) is None  # the file has no entry for the CPU
    with trial_table(trial):
        assert choose("linear", 8, 64, 32, torch.float32, cpu) == config
        assert choose("linear", 5, 64, 32, torch.float32, cpu) == config  # rows bucketed to 8
        assert choose("linear", 16, 64, 32, torch.float32, cpu) is None  # a key the trial lacks: unfused
    assert choose("linear", 8, 64, 32, torch.float32, cpu) is None


def test_a_gpus_name_is_asked_of_the_driver_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fused layer of an eager pass looks its tiles up by the device's name: asked once per GPU, not per call."""
    asked: list[int] = []

    def name(index: int) -> str:
        asked.append(index)
        return f"GPU {index}"

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    small_gemm_table._cuda_name.cache_clear()
    try:
        names = [device_name(torch.device("cuda", i % 2)) for i in range(6)]
        assert names == ["GPU 0", "GPU 1"] * 3 and asked == [0, 1]
        assert device_name(torch.device("cpu")) == "cpu"
    finally:
        small_gemm_table._cuda_name.cache_clear()  # the real names, for the tests after this one

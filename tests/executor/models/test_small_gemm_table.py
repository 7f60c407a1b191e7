"""The fused-GEMM table's merge: a bench run replaces the shapes it timed and keeps the rest."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kernels.small_gemm_table import GemmConfig, merge_winners


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

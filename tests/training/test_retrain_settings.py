"""drafters/retrain.sh keeps the text's settings with the text: the generation writes SEED, SELF_INSTRUCT and
NUM_PROMPTS to data.settings, and a training run on that text (another machine, PHASES=train) takes them from
there where unset and stops, naming the setting, where set otherwise (the prompt list would not be the one the
text answers). The trainer itself is replaced by a stub `python3` that records its arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_retrain(tmp_path: Path, phases: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    environ = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "PHASES": phases, "METHODS": "eagle3"}
    for name in ("SEED", "SELF_INSTRUCT", "NUM_PROMPTS"):
        environ.pop(name, None)
    result = subprocess.run(
        ["bash", "drafters/retrain.sh", "target.gguf", str(tmp_path / "run"), "prompts.jsonl"],
        cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return result, calls.read_text().splitlines() if calls.exists() else []


def flag(call: str, name: str) -> str:
    words = call.split()
    return words[words.index(name) + 1]


def test_the_generation_writes_its_settings(tmp_path: Path) -> None:
    result, calls = run_retrain(tmp_path, "generate", SEED="2", SELF_INSTRUCT="12000")
    assert result.returncode == 0, result.stderr
    settings = (tmp_path / "run" / "data.settings").read_text().split()
    assert settings == ["SEED", "2", "SELF_INSTRUCT", "12000", "NUM_PROMPTS", "60000"]
    assert flag(calls[0], "--seed") == "2" and flag(calls[0], "--self-instruct") == "12000"


def test_training_takes_the_texts_settings_where_unset(tmp_path: Path) -> None:
    run_retrain(tmp_path, "generate", SEED="2", SELF_INSTRUCT="12000")
    result, calls = run_retrain(tmp_path, "train")
    assert result.returncode == 0, result.stderr
    train = calls[-1]
    assert "--stop-after-steps" not in train  # the training call, not the generation's
    assert flag(train, "--seed") == "2" and flag(train, "--self-instruct") == "12000"
    assert flag(train, "--num-prompts") == "60000"


@pytest.mark.parametrize(("name", "value"), [("SEED", "1"), ("SELF_INSTRUCT", "8000")])
def test_training_stops_on_other_settings(tmp_path: Path, name: str, value: str) -> None:
    run_retrain(tmp_path, "generate", SEED="2", SELF_INSTRUCT="12000")
    result, calls = run_retrain(tmp_path, "train", **{name: value})
    assert result.returncode == 2
    assert f"the text was generated with {name}=" in result.stderr and f"not {value}" in result.stderr
    assert len(calls) == 1  # the generation's only: no training started

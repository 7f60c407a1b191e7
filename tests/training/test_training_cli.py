"""`specdec train-drafter` through the `specdec` entry point, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from toy_target import save_toy_target

from specdec_cli.cli import main

TINY_RUN = ["--random-prompts", "24", "--max-new-tokens", "8", "--epochs", "1", "--batch-size", "8",
            "--intermediate-size", "64", "--no-progress", "--device", "cpu"]  # fmt: skip


def test_specdec_train_drafter_writes_the_drafter_and_its_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = save_toy_target(tmp_path / "target")
    argv = ["train-drafter", "--method", "eagle", "--target", str(target), "--out", str(tmp_path / "run"), *TINY_RUN]
    assert main(argv) == 0
    assert "drafter written to" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "run" / "drafter").iterdir()} == {"config.json", "model.safetensors"}
    log = json.loads((tmp_path / "run" / "training_log.json").read_text())
    assert log["command"].startswith("specdec train-drafter --method eagle --target ")
    assert log["steps"] == 3 and log["data"]["sequences"] == 24 and log["drafter"]["dtype"] == "bf16"
    assert (tmp_path / "run" / "data.jsonl").read_text().count("\n") == 24
    assert main(argv) == 1  # a second run into the same directory must ask for --resume
    assert "checkpoint.pt exists: pass --resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "synthetic:tiny", "--corpus", "nowhere"], "no tokenizer: train it on --random-prompts N"),
        (["--target", "synthetic:tiny"], "no tokenizer"),
        (["--target", "synthetic:giant", "--random-prompts", "4"], "unknown synthetic preset 'giant'"),
        (["--target", "no/such/model", "--random-prompts", "4"], "--target"),
    ],
)
def test_bad_runs_are_refused_with_the_reason(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["train-drafter", "--method", "dflash", "--out", str(tmp_path / "run"), *extra]) == 1
    assert message in capsys.readouterr().err

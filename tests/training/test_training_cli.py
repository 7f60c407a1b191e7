"""`specdec train-drafter` through the `specdec` entry point, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from toy_target import save_toy_target

from specdec_cli.cli import main

TINY_RUN = ["--random-prompts", "24", "--max-new-tokens", "8", "--epochs", "1", "--batch-size", "8",
            "--intermediate-size", "64", "--no-progress", "--device", "cpu"]  # fmt: skip
DFLASH_BLOCK = ["--block-size", "4", "--num-anchors", "8"]  # the recipe's 16 and its anchors: 2-3x the time
SMALL_DFLASH = [*DFLASH_BLOCK, "--num-layers", "1"]


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


def test_dense_batch_writes_the_same_greedy_text_as_the_engine(tmp_path: Path) -> None:
    common = ["train-drafter", "--method", "dflash", "--target", "synthetic:tiny", "--temperatures", "0",
              "--stop-after-steps", "1", *TINY_RUN]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "engine")]) == 0
    assert main([*common, "--out", str(tmp_path / "dense"), "--dense-batch", "5"]) == 0
    engine, dense = ((tmp_path / run / "data.jsonl").read_text() for run in ("engine", "dense"))
    assert dense == engine and engine.count("\n") == 24


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "synthetic:tiny", "--corpus", "nowhere"], "no tokenizer: train it on --random-prompts N"),
        (["--target", "synthetic:tiny"], "no tokenizer"),
        (["--target", "synthetic:giant", "--random-prompts", "4"], "unknown synthetic preset 'giant'"),
        (["--target", "no/such/model", "--random-prompts", "4"], "--target"),
        (["--target", "synthetic:tiny", "--random-prompts", "4", "--dense-batch", "-1"], "--dense-batch: -1"),
        (
            ["--target", "synthetic:tiny", "--random-prompts", "4", "--extra-data", "nowhere/data.jsonl"],
            "--extra-data: nowhere/data.jsonl does not exist",
        ),
        (
            ["--target", "synthetic:tiny", "--random-prompts", "4", "--skip-answered", "nowhere/data.jsonl"],
            "--skip-answered: nowhere/data.jsonl does not exist",
        ),
        (
            ["--target", "synthetic:tiny", "--random-prompts", "4", "--skip-answered", "pyproject.toml"],
            "--skip-answered is for text prompts",
        ),
    ],
)
def test_bad_runs_are_refused_with_the_reason(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["train-drafter", "--method", "dflash", "--out", str(tmp_path / "run"), *extra]) == 1
    assert message in capsys.readouterr().err


def test_extra_data_trains_on_text_another_run_generated(tmp_path: Path) -> None:
    """--extra-data: another run's data.jsonl and its round files beside it join this run's sequences before the
    validation split; the log counts them per file."""
    common = ["train-drafter", "--method", "dflash", "--target", "synthetic:tiny", *TINY_RUN, *SMALL_DFLASH]
    assert main([*common, "--seed", "1", "--stop-after-steps", "1", "--out", str(tmp_path / "other")]) == 0
    extra = tmp_path / "other" / "data.jsonl"
    rows = extra.read_text().splitlines(keepends=True)
    (tmp_path / "other" / "data.turn2.jsonl").write_text("".join(rows[:5]))  # a round file beside it
    assert main([*common, "--out", str(tmp_path / "run"), "--extra-data", str(extra)]) == 0
    log = json.loads((tmp_path / "run" / "training_log.json").read_text())
    assert log["data"]["extra"] == {str(extra): 29} and log["data"]["rounds"] == {"first_turns": 24}
    assert log["data"]["sequences"] == 53
    assert log["data"]["train_sequences"] == 52 and log["data"]["validation_sequences"] == 1
    assert log["steps"] == 7  # 52 sequences in batches of 8: the extra ones are trained on
    assert (tmp_path / "run" / "data.jsonl").read_text().count("\n") == 24  # this run's own file is its own text


def test_extra_data_of_another_vocabulary_or_named_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"prompt": [1, 2], "response": [5000], "kind": "x"}) + "\n")
    common = ["train-drafter", "--method", "dflash", "--target", "synthetic:tiny", *TINY_RUN]
    assert main([*common, "--out", str(tmp_path / "run"), "--extra-data", str(foreign)]) == 1
    assert f"--extra-data: {foreign} holds ids past the target's 512-token vocabulary" in capsys.readouterr().err
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": [1, 2], "response": [3], "kind": "x"}) + "\n")
    twice = ["--extra-data", str(data), "--extra-data", str(tmp_path / "." / "data.jsonl")]
    assert main([*common, "--out", str(tmp_path / "twice"), *twice]) == 1
    assert "is named twice (or is --data itself)" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_init_from_goes_on_training_the_published_drafter(method: str, tmp_path: Path) -> None:
    """At lr 0 a run started from a published drafter writes that drafter back unchanged (its weights, EAGLE-3's
    reduced vocabulary and DFlash's mask token kept); a run from scratch at lr 0 does not."""
    from safetensors.torch import load_file

    target = save_toy_target(tmp_path / "target")
    small = SMALL_DFLASH if method == "dflash" else []
    base = ["train-drafter", "--method", method, "--target", str(target), *TINY_RUN, *small]
    assert main([*base, "--out", str(tmp_path / "first")]) == 0
    first = tmp_path / "first" / "drafter"
    frozen = [*base, "--lr", "0", "--seed", "5"]
    assert main([*frozen, "--out", str(tmp_path / "again"), "--init-from", str(first)]) == 0
    assert main([*frozen, "--out", str(tmp_path / "scratch")]) == 0
    published = load_file(str(first / "model.safetensors"))
    again = load_file(str(tmp_path / "again" / "drafter" / "model.safetensors"))
    scratch = load_file(str(tmp_path / "scratch" / "drafter" / "model.safetensors"))
    assert again.keys() == published.keys()
    assert all(torch.equal(again[name], published[name]) for name in published)
    assert not all(torch.equal(scratch[name], published[name]) for name in published)
    config = json.loads((tmp_path / "again" / "drafter" / "config.json").read_text())
    assert config == json.loads((first / "config.json").read_text())
    log = json.loads((tmp_path / "again" / "training_log.json").read_text())
    assert log["init_from"] == str(first)


def test_init_from_refuses_a_drafter_of_another_shape(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = save_toy_target(tmp_path / "target")
    base = ["train-drafter", "--method", "eagle3", "--target", str(target), *TINY_RUN]
    assert main([*base, "--out", str(tmp_path / "first")]) == 0
    wider = [*base, "--intermediate-size", "96", "--init-from", str(tmp_path / "first" / "drafter")]
    assert main([*wider, "--out", str(tmp_path / "wider")]) == 1
    assert "not the recipe's drafter: intermediate_size 64 (recipe 96)" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["dflash", "eagle"])
def test_init_from_grows_a_drafter_by_layers_that_start_as_no_ops(method: str, tmp_path: Path) -> None:
    """--num-layers above the published drafter's: its layers come first, each new layer's output projections
    start at zero, so before training the grown drafter scores exactly what the published one does (the same
    validation metrics as a same-depth --init-from run); at lr 0 the written drafter keeps all of that."""
    from safetensors.torch import load_file

    target = save_toy_target(tmp_path / "target")
    small = DFLASH_BLOCK if method == "dflash" else []
    base = ["train-drafter", "--method", method, "--target", str(target), *TINY_RUN, *small]
    assert main([*base, "--num-layers", "1", "--out", str(tmp_path / "first")]) == 0
    first = tmp_path / "first" / "drafter"
    frozen = [*base, "--lr", "0", "--init-from", str(first)]
    assert main([*frozen, "--num-layers", "1", "--out", str(tmp_path / "same")]) == 0
    assert main([*frozen, "--num-layers", "2", "--out", str(tmp_path / "grown")]) == 0
    same, grown = (json.loads((tmp_path / run / "training_log.json").read_text()) for run in ("same", "grown"))
    assert grown["validation_before"] == same["validation_before"]
    published = load_file(str(first / "model.safetensors"))
    written = load_file(str(tmp_path / "grown" / "drafter" / "model.safetensors"))
    assert all(torch.equal(written[name], published[name]) for name in published)
    new = {name: value for name, value in written.items() if name not in published}
    assert new and all(name.startswith(("layers.1.", "model.layers.1.")) for name in new), sorted(new)
    outputs = [v for name, v in new.items() if "o_proj" in name or "down_proj" in name]
    assert len(outputs) >= 2 and all(not v.any() for v in outputs)
    assert any(v.any() for name, v in new.items() if "q_proj" in name or "qkv" in name)  # drawn, not zero
    config = json.loads((tmp_path / "grown" / "drafter" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2


def test_init_from_keeps_the_published_depth_without_num_layers(tmp_path: Path) -> None:
    """Fine-tuning a published drafter deeper than the recipe's default (the shipped 3-layer DFlash against the
    recipe's 2) keeps its depth when --num-layers is not given, as retrain.sh fine-tunes the shipped drafters."""
    target = save_toy_target(tmp_path / "target")
    base = ["train-drafter", "--method", "dflash", "--target", str(target), *TINY_RUN, *DFLASH_BLOCK]
    assert main([*base, "--num-layers", "3", "--out", str(tmp_path / "first")]) == 0
    assert main([*base, "--init-from", str(tmp_path / "first" / "drafter"), "--out", str(tmp_path / "again")]) == 0
    log = json.loads((tmp_path / "again" / "training_log.json").read_text())
    assert log["recipe"]["num_layers"] == 3
    assert json.loads((tmp_path / "again" / "drafter" / "config.json").read_text())["num_hidden_layers"] == 3


def test_init_from_refuses_to_drop_layers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = save_toy_target(tmp_path / "target")
    base = ["train-drafter", "--method", "dflash", "--target", str(target), *TINY_RUN]
    assert main([*base, "--num-layers", "2", "--out", str(tmp_path / "first")]) == 0
    shallower = [*base, "--num-layers", "1", "--init-from", str(tmp_path / "first" / "drafter")]
    assert main([*shallower, "--out", str(tmp_path / "shallower")]) == 1
    assert "not the recipe's drafter: num_layers 2 (recipe 1)" in capsys.readouterr().err


def test_a_field_error_is_printed_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["train-drafter", "--method", "eagle3", "--target", "synthetic:tiny", "--num-layers", "2", *TINY_RUN]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.count("EAGLE-3 drafters have exactly one layer") == 1, err


def test_train_minutes_stops_the_run_at_the_first_fit_once_over_budget(tmp_path: Path) -> None:
    """--train-minutes through the training loop: a budget already spent when steps 10-30 have set the pace
    ends the run one step later (step 31 of the recipe's 60), and the drafter is still written."""
    target = save_toy_target(tmp_path / "target")
    argv = ["train-drafter", "--method", "eagle", "--target", str(target), "--out", str(tmp_path / "run"), *TINY_RUN]
    assert main([*argv, "--epochs", "20", "--train-minutes", "0.00001"]) == 0
    log = json.loads((tmp_path / "run" / "training_log.json").read_text())
    assert log["steps"] == 31 and log["train_minutes"] == 0.00001

"""`specdec demo` options and their effect without servers: the deadlines --timeout sets (Generate included; a
fixed 600 s deadline failed a run on a loaded machine) and the error for a method with no shipped drafter."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.v1 import executor_pb2
from specdec_cli import demo
from specdec_cli.cli import build_parser
from specdec_cli.demo_drafters import DrafterError, find_drafter
from specdec_cli.demo_output import Output
from specdec_cli.demo_render import render_finished


class RecordingExecutor:
    """Generate answers one final message and records the deadline it was given."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def Generate(self, request: executor_pb2.GenerateRequest, timeout: float | None = None):
        self.timeouts.append(timeout)
        finished = executor_pb2.Finished(finish_reason="length", prompt_tokens=1, completion_tokens=1)
        return iter([executor_pb2.GenerateResponse(token_ids=[7], finished=finished)])


@pytest.mark.parametrize(("argv", "deadline", "short"), [([], None, 10.0), (["--timeout", "1500"], 1500.0, 1500.0)])
def test_generate_deadline_follows_timeout(
    argv: list[str], deadline: float | None, short: float, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["demo", "--synthetic", "--prompt", "hi", *argv])
    executor = RecordingExecutor()
    info = executor_pb2.ModelInfo(vocab_size=512)
    demo._generate(args, Output(False), SimpleNamespace(chat=None), executor, info)  # type: ignore[arg-type]
    assert executor.timeouts == [deadline]
    assert demo.short_deadline(args) == short


@pytest.mark.parametrize("seconds", ["0", "-3", "nan"])
def test_timeout_must_be_positive(seconds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", "--timeout", seconds])
    assert exited.value.code == 2 and "argument --timeout" in capsys.readouterr().err


def test_a_method_without_a_shipped_drafter_says_how_to_train_one(tmp_path: Path) -> None:
    (tmp_path / "smollm2-eagle3").mkdir()
    (tmp_path / "smollm2-eagle3" / "config.json").write_text("{}")
    with pytest.raises(DrafterError) as refused:
        find_drafter(tmp_path, {"eagle": "smollm2-eagle", "eagle3": "smollm2-eagle3"}, "eagle")
    message = str(refused.value)
    assert "no eagle drafter" in message and "available in" in message
    assert "specdec train-drafter --method eagle" in message and "drafters/train.sh" in message


@pytest.mark.parametrize("temperature", ["-1", "nan", "inf", "-0.5"])
def test_temperature_is_checked_before_any_server_starts(temperature: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The executor refuses these (sampling.temperature); the demo used to find out only after starting both
    servers and loading the model. Refused at parse time now: exit 2, before run_demo."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["demo", "--temperature", temperature])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --temperature: must be a finite number >= 0" in err


def test_k_help_says_eagle3_with_k_3(capsys: pytest.CaptureFixture[str]) -> None:
    """ "EAGLE 3 on CUDA" read as the method EAGLE-3; it meant EAGLE-3 with k = 3."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "EAGLE-3 with k = 3 on CUDA and k = 7 on the CPU" in shown and "EAGLE 3" not in shown


@pytest.mark.parametrize(
    ("tokens", "seconds", "shown"), [(2, 5.0, "0.4"), (1, 300.0, "0.0033"), (7, 2.0, "3.5"), (43, 1.0, "43")]
)
def test_slow_rates_are_not_shown_as_zero(tokens: int, seconds: float, shown: str) -> None:
    finished = executor_pb2.Finished(finish_reason="length", prompt_tokens=1, completion_tokens=tokens)
    assert f"generated in {seconds:.2f} s ({shown} tokens/s)" in render_finished(finished, seconds)


def test_an_interrupted_stream_ends_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C mid-stream printed `def is_primeinterrupted`: the error now starts a line of its own."""
    out = Output(False)
    out.stream("def is_prime")
    out.error("interrupted")
    out.stream("more\n")
    out.line("next")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("def is_prime\nmore\nnext\n", "interrupted\n")

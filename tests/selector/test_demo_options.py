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

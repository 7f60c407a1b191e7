"""The executor's command line turns adaptive speculation on by default for one CUDA GPU only (measured there:
docs/executor.md); the CPU and tensor parallelism keep the loaded k every step unless told otherwise, and either
flag overrides the default."""

from __future__ import annotations

import pytest

import executor_service.server.main as executor_main
from executor_service.server.main import ExecutorOptions


def engine_options(monkeypatch: pytest.MonkeyPatch, *argv: str) -> ExecutorOptions:
    """The options main() would serve with (nothing served: `serve` returns at once)."""
    seen: list[ExecutorOptions] = []

    async def serve(settings: object, options: ExecutorOptions, load: object) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr(executor_main, "serve", serve)
    monkeypatch.setattr(executor_main, "configure_logging", lambda *args: None)
    assert executor_main.main(["--port", "0", *argv]) == 0
    return seen[0]


@pytest.mark.parametrize(
    ("argv", "adaptive"),
    [
        (("--device", "cuda"), True),
        (("--device", "cuda:1"), True),
        (("--device", "cpu"), False),
        (("--device", "cuda", "--tensor-parallel-size", "2"), False),
        (("--device", "cuda", "--no-adaptive-speculation"), False),
        (("--device", "cpu", "--adaptive-speculation"), True),
        (("--device", "cuda", "--tensor-parallel-size", "2", "--adaptive-speculation"), True),
    ],
)
def test_the_default_and_its_overrides(monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], adaptive: bool) -> None:
    assert engine_options(monkeypatch, *argv).engine.adaptive_speculation is adaptive

"""The benchmark scripts' --help describes the script that was run, also where one borrows another's flags."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# pass_profile.py reuses specdec_bench.parse_args; prefix_cache_bench.py imports specdec_bench
SCRIPTS = ("specdec_bench", "pass_profile", "load_bench", "prefix_cache_bench", "tp_bench", "adaptive_engine_check")


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_the_scripts_own_description(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    modules = {name: importlib.import_module(name) for name in SCRIPTS}
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        modules[script].main()
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for name, module in modules.items():
        first_line = module.__doc__.splitlines()[0]
        assert (first_line in shown) == (name == script), f"{script} --help:\n{shown}"

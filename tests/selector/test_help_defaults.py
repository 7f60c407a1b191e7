"""--help of every command shows the options' defaults (issue: a new user could not tell what an option does
when left out)."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = {
    "specdec demo": ["-m", "specdec_cli.cli", "demo", "--help"],
    "specdec select": ["-m", "specdec_cli.cli", "select", "--help"],
    "specdec-selector": ["-m", "selector_service.main", "--help"],
    "specdec-executor": ["-m", "executor_service.server.main", "--help"],
}
# An option of each whose default the help must show.
EXPECTED = {
    "specdec demo": "(default: 128)",  # --max-tokens
    "specdec select": "(default: ",
    "specdec-selector": "(default: ",
    "specdec-executor": "(default: ",
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_defaults(name: str) -> None:
    done = subprocess.run([sys.executable, *COMMANDS[name]], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert EXPECTED[name] in done.stdout, done.stdout[-3000:]

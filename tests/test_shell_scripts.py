"""Every shell script of the repository parses (`bash -n`): the GPU scripts (bench/gpu_run.sh,
scripts/gpu_tp_check.sh, ...) run only on a lent GPU host, where a syntax error would cost a call of device time
before anything ran; here it costs nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIPPED = {".venv", "node_modules", ".git", "smol", ".whl", "scratch"}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def shell_scripts() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.sh") if not SKIPPED & set(p.relative_to(REPO).parts))


def parses(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)


def test_the_gpu_scripts_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in shell_scripts()}
    assert {"bench/gpu_run.sh", "scripts/gpu_tp_check.sh"} <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shell_script_parses(script: Path) -> None:
    result = parses(script)
    assert result.returncode == 0, result.stderr


def test_a_script_with_a_syntax_error_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "broken.sh"
    broken.write_text('for step in a b; do\n  case $step in\n    a) echo "$step" ;;\ndone\n')  # no esac
    assert parses(broken).returncode != 0

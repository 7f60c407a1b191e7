"""scripts/run.sh and scripts/test.sh, run on a copy of their inputs with fake tools that log their calls: run.sh
installs only when .venv is missing or what it installs changed, and says what it is doing, and a second run.sh
started meanwhile waits for the first's install; test.sh without Node.js skips the Node steps, saying so, instead
of stopping with exit 127, and its npm installs never rewrite a lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from compose_local import REPO_ROOT

TIMEOUT_S = 60  # only against hanging; these scripts run fake tools


def write_tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def copy_script(tmp_path: Path, name: str) -> Path:
    """A checkout of one script and pyproject.toml in tmp_path (the scripts cd to their parent's parent)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path / "scripts" / name


def run_script(script: Path, path: str, log: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(PATH=path, CALLS=str(log), **extra_env)
    return subprocess.run(
        ["/bin/bash", str(script), *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def calls(log: Path) -> list[str]:
    """The logged calls, and empties the log."""
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_run_sh_installs_once_and_again_when_pyproject_changes(tmp_path: Path) -> None:
    script = copy_script(tmp_path, "run.sh")
    fake_bin = tmp_path / "fake-bin"
    # `python3 -m venv .venv` makes a .venv whose python and specdec only log their arguments.
    logger = 'echo "$(basename "$0") $*" >>"$CALLS"'
    write_tool(
        fake_bin / "python3",
        f'{logger}\nmkdir -p .venv/bin\nfor t in python specdec; do printf "#!/bin/bash\\n%s\\n" '
        f"'{logger}' >.venv/bin/$t; chmod +x .venv/bin/$t; done",
    )
    path, log = f"{fake_bin}:/usr/bin:/bin", tmp_path / "calls.log"

    first = run_script(script, path, log, "--help")
    assert first.returncode == 0, first.stderr
    first_calls = calls(log)
    assert first_calls[0] == "python3 -m venv .venv"
    assert any(c.startswith("python -m pip install -q torch==") for c in first_calls), first_calls
    assert first_calls[-1] == "specdec demo --help"
    assert "== installing torch==" in first.stderr and first.stdout == ""

    again = run_script(script, path, log, "--help")
    assert again.returncode == 0, again.stderr
    assert calls(log) == ["specdec demo --help"]  # nothing changed: no venv, no pip
    assert "== python environment: .venv is up to date" in again.stderr

    with (tmp_path / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# changed\n")
    changed = run_script(script, path, log, "--synthetic")
    assert changed.returncode == 0, changed.stderr
    changed_calls = calls(log)
    assert any(c.startswith("python -m pip install") for c in changed_calls), changed_calls
    assert changed_calls[-1] == "specdec demo --synthetic"

    shutil.rmtree(tmp_path / ".venv")
    recreated = run_script(script, path, log)
    assert recreated.returncode == 0, recreated.stderr
    assert calls(log)[0] == "python3 -m venv .venv"


def no_node_path(tmp_path: Path) -> Path:
    """A PATH directory with what test.sh needs besides node, npm and npx."""
    tools = tmp_path / "no-node-bin"
    tools.mkdir()
    for name in ("dirname", "cat", "printf"):
        found = shutil.which(name)
        if found:
            (tools / name).symlink_to(found)
    return tools


def test_test_sh_without_node_skips_the_node_steps(tmp_path: Path) -> None:
    script = copy_script(tmp_path, "test.sh")
    for tool in ("python", "ruff", "pytest"):  # each logs its call and succeeds
        write_tool(tmp_path / ".venv" / "bin" / tool, f'echo "{tool} $*" >>"$CALLS"')
    tools = no_node_path(tmp_path)
    log = tmp_path / "calls.log"

    result = run_script(script, str(tools), log, "-x", SPECDEC_SKIP_INSTALL="1")
    assert result.returncode == 0, f"{result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "node or npm is not on PATH: skipped" in result.stdout
    assert calls(log) == [
        "python protos/generate.py --check",
        "ruff check .",
        "ruff format --check .",
        "python -c import xdist",
        "pytest -q -ra -n auto --dist loadfile --durations=20 -x",
    ]


def test_two_first_run_sh_at_once_install_once(tmp_path: Path) -> None:
    """A second run.sh started while the first installs waits for it (flock on .venv), then finds .venv up to
    date: one install, both demos run. Without the lock both installed into the same .venv and pip failed."""
    script = copy_script(tmp_path, "run.sh")
    fake_bin = tmp_path / "fake-bin"
    logger = 'echo "$$ $(basename "$0") $*" >>"$CALLS"'
    # The fake venv creation holds the first install until the test creates `release`.
    write_tool(
        fake_bin / "python3",
        f'{logger}\ntouch "$CALLS.installing"\nwhile [[ ! -e "$CALLS.release" ]]; do sleep 0.05; done\n'
        f'mkdir -p .venv/bin\nfor t in python specdec; do printf "#!/bin/bash\\n%s\\n" '
        f"'{logger}' >.venv/bin/$t; chmod +x .venv/bin/$t; done",
    )
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(PATH=f"{fake_bin}:/usr/bin:/bin", CALLS=str(log))

    def start() -> subprocess.Popen[str]:
        command = ["/bin/bash", str(script), "--help"]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start()
    try:
        wait_for(lambda: Path(f"{log}.installing").exists(), first)
        second = start()
        waiting = second.stderr.readline()  # type: ignore[union-attr]
    finally:
        Path(f"{log}.release").touch()  # a failed check leaves no fake install waiting
    assert waiting == "== waiting for another install into .venv to finish\n", waiting
    outcomes = [process.communicate(timeout=TIMEOUT_S) for process in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), outcomes
    assert "== python environment: .venv is up to date" in outcomes[1][1]
    logged = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert logged.count("python3 -m venv .venv") == 1, logged
    assert logged.count("specdec demo --help") == 2, logged


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    """Until `condition` holds; fails if `process` exits first (polls: the fake tools only write files)."""
    while not condition():
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)


def test_npm_installs_leave_the_locks_alone() -> None:
    """scripts/test.sh installs node packages with `npm ci` only (never rewrites a lock, so `git status` stays
    clean), and every lock holds each optional package it declares (buf's binaries for every platform), without
    which ci refuses it. protos/ used `npm install`, which added other platforms' entries to its lock."""
    script = (REPO_ROOT / "scripts" / "test.sh").read_text()
    installs = re.findall(r"\(cd (\S+) && npm (\w+)", script)  # each is `(cd DIR && npm ...)`
    assert installs and {command for _, command in installs} == {"ci"}, installs
    for lock_path, _ in installs:
        packages = json.loads((REPO_ROOT / lock_path / "package-lock.json").read_text())["packages"]
        for name, entry in packages.items():
            for optional in entry.get("optionalDependencies", {}):
                where = f"{name}/node_modules/{optional}" if name else f"node_modules/{optional}"
                assert where in packages or f"node_modules/{optional}" in packages, (lock_path, optional)


def test_test_sh_runs_pytest_in_parallel_and_lists_the_slowest(tmp_path: Path) -> None:
    """pytest-xdist is in the dev extra test.sh installs; SPECDEC_TEST_WORKERS sets the workers; without xdist in
    an older .venv the suite runs in one process, saying so (it always ran in one, 18 minutes on CI)."""
    dev = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(requirement.startswith("pytest-xdist") for requirement in dev), dev
    script = copy_script(tmp_path, "test.sh")
    for tool in ("ruff", "pytest"):
        write_tool(tmp_path / ".venv" / "bin" / tool, f'echo "{tool} $*" >>"$CALLS"')
    log = tmp_path / "calls.log"
    write_tool(tmp_path / ".venv" / "bin" / "python", 'echo "python $*" >>"$CALLS"')
    tools = str(no_node_path(tmp_path))
    result = run_script(script, tools, log, "tests/selector", SPECDEC_SKIP_INSTALL="1", SPECDEC_TEST_WORKERS="3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(log)[-1] == "pytest -q -ra -n 3 --dist loadfile --durations=20 tests/selector"
    write_tool(tmp_path / ".venv" / "bin" / "python", 'echo "python $*" >>"$CALLS"; [[ "$1" != -c ]]')
    result = run_script(script, tools, log, SPECDEC_SKIP_INSTALL="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pytest-xdist is not installed in .venv" in result.stdout
    assert calls(log)[-1] == "pytest -q -ra --durations=20"

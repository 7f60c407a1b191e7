"""The Node.js contract tests' runner: `run_node(script, server)` runs `node SCRIPT HOST:PORT` in tests/contract/node
and returns its stdout, failing the test (with the server's log) unless it exits 0 in time.

Needs `node` on PATH and `npm install` run in tests/contract/node; tests that ask for `run_node` are skipped
otherwise, before any server they ask for after it starts.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
NODE_TIMEOUT_S = 60


@pytest.fixture
def run_node() -> Callable[..., str]:
    executable = shutil.which("node")
    if executable is None:
        pytest.skip("node is not on PATH: install Node.js 20+ to run the Node.js contract tests")
    if not (NODE_DIR / "node_modules").is_dir():
        pytest.skip(f"{NODE_DIR / 'node_modules'} is missing: run `npm install` in {NODE_DIR}")

    def run(script: str, server) -> str:
        try:
            result = subprocess.run(
                [executable, script, server.address],
                cwd=NODE_DIR,
                capture_output=True,
                text=True,
                timeout=NODE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"node ran past {NODE_TIMEOUT_S} s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}")
        assert result.returncode == 0, (
            f"node exited with status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n"
            f"{server.service} log:\n{server.log()}"
        )
        print(result.stdout, end="")
        return result.stdout

    return run

"""Contract test: a Node.js gRPC client (@grpc/grpc-js, @grpc/proto-loader) against a real selector server.

Needs `node` on PATH and `npm install` run in tests/contract/node; skipped otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent / "node"
NODE_TIMEOUT_S = 60


@pytest.fixture
def node() -> str:
    """The node executable; skips the test (before any server starts) when Node.js or the packages are missing."""
    executable = shutil.which("node")
    if executable is None:
        pytest.skip("node is not on PATH: install Node.js 20+ to run the Node.js contract test")
    if not (NODE_DIR / "node_modules").is_dir():
        pytest.skip(f"{NODE_DIR / 'node_modules'} is missing: run `npm install` in {NODE_DIR}")
    return executable


@pytest.mark.node
def test_node_client_against_selector(node: str, selector_server, selector_address: str) -> None:
    try:
        result = subprocess.run(
            [node, "selector_contract.mjs", selector_address],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"node ran past {NODE_TIMEOUT_S} s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}")
    assert result.returncode == 0, (
        f"node exited with status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}\n"
        f"selector log:\n{selector_server.log()}"
    )
    print(result.stdout, end="")

    # Graceful shutdown is part of the contract: SIGTERM drains and exits 0 within the grace period.
    status = selector_server.stop()
    assert status == 0, selector_server.shutdown_failure()

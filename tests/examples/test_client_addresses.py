"""Each example client (Python, Node.js, Go) given a bad address: a port out of range is refused with the usage
(exit 2; Python dialled 99999 as 34463), a refused port is reported from the refusal itself (the Go client waited
30 s for DEADLINE_EXCEEDED, the Python one 10 s for its connect deadline), and the selector's address given as the
executor's names the service that answers there (all three printed only "UNIMPLEMENTED: Method not found!")."""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from example_clients import EXAMPLES, REPO_ROOT, build_go_client, run_client

REFUSED = {"python": "Connection refused", "node": "ECONNREFUSED", "go": "connection refused"}


@pytest.fixture(params=["python", "node", "go"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, list[str], Path]:
    """(language, command, working directory) of one example client; skipped, saying why, without its tools."""
    if request.param == "python":
        return "python", [sys.executable, str(EXAMPLES / "python" / "client.py")], REPO_ROOT
    if request.param == "node":
        node = shutil.which("node")
        if node is None or not (EXAMPLES / "node" / "node_modules").is_dir():
            pytest.skip("node or examples/node/node_modules is missing: install Node.js 20+ and run `npm ci` there")
        return "node", [node, "client.mjs"], EXAMPLES / "node"
    built = build_go_client(tmp_path / "go")
    if isinstance(built, str):
        pytest.skip(built)
    return "go", [str(built)], REPO_ROOT


def closed_port_address() -> str:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_bad_addresses(client: tuple[str, list[str], Path], launch_server: Callable) -> None:
    language, command, cwd = client
    dash = "-" if language == "go" else "--"
    refused = run_client([*command, f"{dash}executor=127.0.0.1:99999"], cwd, {})
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
    assert "'127.0.0.1:99999': 99999 is not a port in 1..65535" in refused.stderr.replace('"', "'"), refused.stderr

    address = closed_port_address()
    result = run_client([*command, f"{dash}executor={address}"], cwd, {})
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    flag = f"{dash}executor / $SPECDEC_EXECUTOR"
    assert result.stderr.startswith(f"error: cannot reach the executor at {address} ({flag}): UNAVAILABLE: ")
    assert REFUSED[language] in result.stderr and result.stderr.count("\n") == 1, result.stderr

    selector = launch_server("selector").address
    wrong = run_client([*command, f"{dash}executor={selector}", f"{dash}selector={selector}"], cwd, {})
    assert (wrong.returncode, wrong.stdout) == (1, ""), wrong.stderr
    assert wrong.stderr == (
        f"error: the executor at {selector} ({flag}) is not a specdec executor: its health service names "
        "specdec.v1.BackendSelector (a specdec selector) there, not specdec.v1.Executor\n"
    )

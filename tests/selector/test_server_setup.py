"""A selector that cannot start says why in one line and exits 2: a TLS key that is not the certificate's, an
address in use, a port out of range. Before, the first two ended in a traceback ("Failed to bind") and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from certs import make_tls_files

from specdec_runtime.grpc_runtime import EnvDefaultsParser, add_server_arguments

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0  # only so that a server that starts after all cannot hang the test


def run_selector(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "selector_service.main", "--log-format", "text", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The process's only output line, which must be its error; fails with the whole output otherwise."""
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, f"exit status {result.returncode}:\n{output}"
    assert "Traceback" not in output, output
    lines = output.splitlines()
    assert len(lines) == 1, output
    return lines[0]


def test_a_tls_key_that_is_not_the_certificates(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    result = run_selector("--port", "0", "--tls-cert", str(tls.server_cert), "--tls-key", str(tls.client_key))
    line = one_error_line(result)
    assert "cannot serve" in line and f"--tls-key {tls.client_key} is not the private key of --tls-cert" in line


def test_a_port_in_use(busy_port: int) -> None:
    line = one_error_line(run_selector("--host", "127.0.0.1", "--port", str(busy_port)))
    assert f"cannot bind 127.0.0.1:{busy_port}" in line and "in use" in line, line


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range(port: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--port (or SPECDEC_PORT) must be 0..65535 (0: any free port); --metrics-port -1..65535 (-1: off)."""
    for argv in (["--port", port], ["--metrics-port", "65536"]):
        with pytest.raises(SystemExit) as exited:
            parser().parse_args(argv)
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port:" in err and "argument --metrics-port:" in err
    monkeypatch.setenv("SPECDEC_PORT", port)
    with pytest.raises(SystemExit) as exited:
        parser().parse_args([])
    assert exited.value.code == 2
    assert f"SPECDEC_PORT='{port}' (for --port)" in capsys.readouterr().err
    assert [parser().parse_args(["--port", p]).port for p in ("0", "65535")] == [0, 65535]


def parser() -> EnvDefaultsParser:
    built = EnvDefaultsParser(prog="specdec-selector")
    add_server_arguments(built, default_port=50051)
    return built

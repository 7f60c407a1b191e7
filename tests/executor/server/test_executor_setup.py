"""An executor that cannot start logs one line saying why and exits 2: a TLS key that is not the
certificate's, an address in use, a port out of range, an unknown device. Before, the first two raised
RuntimeError "Failed to bind" out of main (a traceback, exit 1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from certs import make_tls_files

import executor_service.server.main as executor_main


@pytest.fixture
def run_main(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):  # type: ignore[no-untyped-def]
    """main(argv) in this process (no torch import to wait for), its logging left to caplog; returns the exit
    status and the one error it logged."""
    monkeypatch.setattr(executor_main, "configure_logging", lambda *args: None)
    caplog.set_level(logging.INFO)

    def run(*argv: str) -> tuple[int, str]:
        caplog.clear()
        status = executor_main.main(["--device", "cpu", "--log-format", "text", *argv])
        errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
        assert len(errors) == 1, [record.getMessage() for record in errors]
        assert errors[0].exc_info is None, "a traceback was logged"
        message = errors[0].getMessage()
        assert "\n" not in message
        return status, message

    return run


def test_a_tls_key_that_is_not_the_certificates(run_main, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tls = make_tls_files(tmp_path)
    status, message = run_main("--port", "0", "--tls-cert", str(tls.server_cert), "--tls-key", str(tls.client_key))
    assert status == 2
    assert message.startswith("cannot serve: --tls-key") and "is not the private key of --tls-cert" in message


def test_a_port_in_use(run_main, busy_port: int) -> None:  # type: ignore[no-untyped-def]
    status, message = run_main("--host", "127.0.0.1", "--port", str(busy_port))
    assert status == 2
    assert message.startswith(f"cannot serve: cannot bind 127.0.0.1:{busy_port}") and "in use" in message


def test_an_unknown_device(run_main) -> None:  # type: ignore[no-untyped-def]
    status, message = run_main("--port", "0", "--device", "tpu:9")
    assert status == 2 and message.startswith("cannot serve: --device 'tpu:9'")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_ports_out_of_range(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        executor_main.main(["--device", "cpu", "--load", "/nonexistent/load.yaml", flag, "65536"])  # never serves
    assert exited.value.code == 2
    assert f"argument {flag}: 65536 is not a port in 1..65535" in capsys.readouterr().err


def test_a_selector_address_with_a_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        executor_main.main(["--device", "cpu", "--port", "0", "--selector-address", "127.0.0.1:99999"])
    assert exited.value.code == 2
    assert "argument --selector-address: '127.0.0.1:99999': 99999 is not a port in 1..65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("load.yaml", "target: [unclosed\n", "not valid YAML: "),
        ("load.json", '{"target": ', "not valid JSON: "),
        ("load.yaml", "no_such_field: 1\n", 'has no field named "no_such_field"'),
    ],
)
def test_a_malformed_load_file(run_main, tmp_path: Path, name: str, text: str, said: str) -> None:  # type: ignore[no-untyped-def]
    """A --load file that is not a LoadModelRequest: one line naming it, exit 2, before the server starts (a
    YAML error was a traceback from inside the running server, then a second one, "Event loop is closed")."""
    load = tmp_path / name
    load.write_text(text)
    status, message = run_main("--port", "0", "--load", str(load))
    assert status == 2
    assert message.startswith(f"cannot serve: --load {load}: ") and said in message


def test_a_model_root_that_is_not_a_directory(run_main, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """--model-root must exist at start (it started without a word, then refused every path LoadModel)."""
    status, message = run_main("--port", "0", "--model-root", str(tmp_path / "nonexistent"))
    assert (status, message) == (2, f"cannot serve: --model-root {tmp_path / 'nonexistent'}: does not exist")
    (tmp_path / "file").write_text("")
    status, message = run_main("--port", "0", "--model-root", str(tmp_path / "file"))
    assert (status, message) == (2, f"cannot serve: --model-root {tmp_path / 'file'}: is not a directory")

"""deploy/healthcheck.py, the compose health probe, against real selector servers: plain, TLS and mTLS set up
from the same environment variables the server reads, and the failures Docker must see as unhealthy (exit 1)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType

import pytest
from certs import TlsFiles, make_tls_files
from compose_local import REPO_ROOT


def load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", REPO_ROOT / "deploy" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROBE = load_probe()


@pytest.fixture
def probe(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str]]:
    """probe(env) -> (exit status, stderr), run in-process with exactly `env` as the environment."""

    def run(env: dict[str, str], *argv: str) -> tuple[int, str]:
        status = PROBE.main(list(argv), env)
        return status, capsys.readouterr().err

    return run


@pytest.fixture
def tls(tmp_path) -> TlsFiles:  # type: ignore[no-untyped-def]
    return make_tls_files(tmp_path)


def test_plain_server_is_healthy_and_a_closed_port_is_not(launch_server, probe) -> None:  # type: ignore[no-untyped-def]
    server = launch_server("selector")
    # A wildcard bind address (compose sets 0.0.0.0) is probed on localhost.
    assert probe({"SPECDEC_PORT": str(server.port), "SPECDEC_HOST": "0.0.0.0"}) == (0, "")
    assert server.stop() == 0
    status, err = probe({"SPECDEC_PORT": str(server.port)})
    assert status == 1 and "UNAVAILABLE" in err, err


def test_no_port_is_unhealthy_not_dockers_reserved_status_2(probe) -> None:  # type: ignore[no-untyped-def]
    status, err = probe({})
    assert status == 1 and "no port" in err, err


def test_tls_from_the_servers_own_variables(launch_server, probe, tls: TlsFiles) -> None:  # type: ignore[no-untyped-def]
    server = launch_server("selector", "--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key))
    env = {
        "SPECDEC_PORT": str(server.port),
        "SPECDEC_HOST": "127.0.0.1",
        "SPECDEC_TLS_CERT": str(tls.server_cert),
        "SPECDEC_TLS_KEY": str(tls.server_key),
    }
    status, err = probe(env)
    assert status == 1 and "set SPECDEC_HEALTHCHECK_TLS_CA" in err, err
    with_ca = {**env, "SPECDEC_HEALTHCHECK_TLS_CA": str(tls.ca)}
    assert probe(with_ca) == (0, "")
    status, err = probe({**with_ca, "SPECDEC_HEALTHCHECK_TLS_SERVER_NAME": "elsewhere.example"})
    assert status == 1 and "UNAVAILABLE" in err, err  # the certificate does not name that host
    status, err = probe({"SPECDEC_PORT": str(server.port)})  # plaintext against a TLS server
    assert status == 1 and "UNAVAILABLE" in err, err


def test_mtls_needs_the_probes_client_certificate(launch_server, probe, tls: TlsFiles) -> None:  # type: ignore[no-untyped-def]
    server = launch_server(
        "selector",
        *("--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key), "--tls-client-ca", str(tls.ca)),
    )
    env = {
        "SPECDEC_PORT": str(server.port),
        "SPECDEC_TLS_CERT": str(tls.server_cert),
        "SPECDEC_TLS_CLIENT_CA": str(tls.ca),
        "SPECDEC_HEALTHCHECK_TLS_CA": str(tls.ca),
    }
    status, err = probe(env)
    assert status == 1 and "requires client certificates" in err, err
    client = {"SPECDEC_HEALTHCHECK_TLS_CERT": str(tls.client_cert), "SPECDEC_HEALTHCHECK_TLS_KEY": str(tls.client_key)}
    assert probe({**env, **client}) == (0, "")
    # Flags win over the environment, as with the servers.
    status, err = probe({**env, **client}, "--port", "1")
    assert status == 1 and "UNAVAILABLE" in err, err

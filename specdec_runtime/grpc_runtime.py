"""What every specdec gRPC server shares: flags (each also read from an environment variable of the same
name), channel options, TLS / mTLS, an optional bearer token, health and reflection, metrics, and graceful
shutdown on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec_runtime.auth import TokenAuthInterceptor, resolve_token
from specdec_runtime.health_status import HealthServicer
from specdec_runtime.observability import ObservingInterceptor, RpcMetrics

log = logging.getLogger("specdec.server")

MiB = 1 << 20
# Responses, and requests of a server that names no bound of its own (create_server's max_request_bytes).
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
# Exit status of a server that cannot start: a bad flag, an unusable certificate, an address in use.
EXIT_BAD_SETUP = 2


def env_name(flag: str) -> str:
    """--metrics-port -> SPECDEC_METRICS_PORT: the environment variable that sets a flag's default."""
    return "SPECDEC_" + flag.lstrip("-").replace("-", "_").upper()


class _BadEnvDefault:
    """An environment value its flag's type or choices refuse: an error only when the flag does not override it."""

    def __init__(self, message: str) -> None:
        self.message = message


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's line breaks and shows every option's default (unless its help already
    says what the default is)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default" in text.lower() else super()._get_help_string(action)


class EnvDefaultsParser(argparse.ArgumentParser):
    """argparse whose options default to SPECDEC_<FLAG> from the environment (flags still win).

    argparse checks neither the choices of a default nor (until parsing) its type, so an environment value is
    checked here and, when bad, refused at parse time like a bad flag (exit 2), naming the variable.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: str, **kwargs: object) -> argparse.Action:  # type: ignore[override]
        long = next((a for a in args if a.startswith("--")), None)
        if long is not None and long != "--help":
            var = env_name(long)
            if var in os.environ:
                value = os.environ[var]
                if kwargs.get("action") == "store_true":
                    kwargs["default"] = value.strip().lower() in ("1", "true", "yes", "on")
                else:
                    kwargs["default"] = self._env_default(long, var, value, kwargs)
            help_text = kwargs.get("help")
            if isinstance(help_text, str):
                kwargs["help"] = f"{help_text} [env {var}]"
        return super().add_argument(*args, **kwargs)

    def _env_default(self, flag: str, var: str, value: str, kwargs: dict[str, object]) -> object:
        """The value converted by the flag's type and within its choices, or what is wrong with it."""
        convert = self._registry_get("type", kwargs.get("type"), kwargs.get("type"))
        where = f"{var}={value!r} (for {flag})"
        try:
            converted = convert(value) if callable(convert) else value
        except argparse.ArgumentTypeError as err:
            return _BadEnvDefault(f"{where}: {err}")
        except (TypeError, ValueError):
            return _BadEnvDefault(f"{where}: invalid {getattr(convert, '__name__', repr(convert))} value")
        choices = kwargs.get("choices")
        if choices is not None and converted not in choices:
            return _BadEnvDefault(f"{where}: invalid choice (choose from {', '.join(map(repr, choices))})")
        return converted

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        bad = [value.message for value in vars(parsed).values() if isinstance(value, _BadEnvDefault)]
        if bad:
            self.error("; ".join(bad))
        return parsed, extras


def port_number(text: str) -> int:
    """A TCP port for --port: 1..65535, or 0 for any free port."""
    return _int_in(text, 0, 65535, "a port in 1..65535 (0: any free port)")


def metrics_port_number(text: str) -> int:
    """--metrics-port: a port, 0 for any free one, -1 for none."""
    return _int_in(text, -1, 65535, "a port in 1..65535 (0: any free port; -1: off)")


def message_bytes(text: str) -> int | None:
    """--max-message-bytes: a positive size, or "" (an unset compose variable) for the service's own limit."""
    if not text.strip():
        return None
    return _int_in(text, 1, (1 << 31) - 1, "a size in bytes, 1..2147483647")


def _int_in(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None  # argparse's own words
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=port_number, default=default_port, help="gRPC port (0: any free port)")
    parser.add_argument("--tls-cert", help="PEM server certificate; with --tls-key, serve TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="PEM CA bundle; clients must present a certificate it signed (mTLS)")
    parser.add_argument(
        "--auth-token", help="shared token: every call but health needs metadata 'authorization: Bearer <token>'"
    )
    parser.add_argument("--auth-token-file", help="read the shared token from this file (keeps it out of argv and env)")
    parser.add_argument(
        "--max-message-bytes",
        type=message_bytes,
        default=None,
        help="largest request or response (default: requests up to the largest valid one of the service, "
        "responses up to 64 MiB); larger ones get RESOURCE_EXHAUSTED before they are read",
    )
    parser.add_argument("--grace-seconds", type=float, default=5.0, help="drain time on SIGTERM")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus /metrics endpoint")
    parser.add_argument(
        "--metrics-port", type=metrics_port_number, default=-1, help="Prometheus port (0: any free; -1: off)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe level logged (stderr)",
    )
    parser.add_argument(
        "--log-format", default="json", choices=["json", "text"], help="json: one JSON object a line; text: plain lines"
    )
    parser.add_argument("--port-file", help="write the bound gRPC port here once the server answers (for --port 0)")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    auth_token_file: str | None = None
    max_message_bytes: int | None = None  # None: the service's own request bound, 64 MiB responses
    grace_seconds: float = 5.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = -1
    port_file: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def server_options(
    settings: ServerSettings, max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[tuple[str, int]]:
    """Channel options; a request over `max_request_bytes` (or --max-message-bytes when given) is refused by
    gRPC with RESOURCE_EXHAUSTED before any of it reaches Python."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", settings.max_message_bytes or max_request_bytes),
        # Clients that ping during long calls must not be sent GOAWAY (SGLang's lesson).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials when a certificate is configured; mTLS when a client CA is too."""
    if not settings.tls_cert and not settings.tls_key:
        if settings.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    check_tls_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    key, cert = Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes()
    client_ca = Path(settings.tls_client_ca).read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """ValueError saying what is wrong with the PEM files (gRPC itself only fails to bind, with a traceback):
    a key that does not belong to the certificate, a file that is not PEM, an unreadable one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # no prompt for an encrypted key
    except ssl.SSLError as err:
        if "KEY_VALUES_MISMATCH" in str(err):
            raise ValueError(f"--tls-key {key} is not the private key of --tls-cert {cert}") from None
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and key ({err})") from None
    except OSError as err:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: {err.strerror or err}") from None
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError) as err:
            raise ValueError(f"--tls-client-ca {client_ca}: not a readable PEM CA bundle ({err})") from None


def check_bindable(host: str, port: int) -> None:
    """OSError naming the address when it cannot be bound (in use, or not this machine's), checked with a
    plain socket first: gRPC only says "Failed to bind". Port 0 always binds."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"cannot bind {host}:{port}: {err.strerror}") from None
    problems = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
                return  # gRPC serves if any resolved address binds
            except OSError as err:
                problems.append(err.strerror or str(err))
    raise OSError(f"cannot bind {host}:{port}: {'; '.join(dict.fromkeys(problems))}")


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: HealthServicer
    port: int
    metrics: RpcMetrics
    metrics_port: int | None
    services: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def wait_until_quiet(self, quiet: float, longest: float) -> None:
        """Keep serving until no call has come in for `quiet` seconds (`longest` at most), before a final stop.

        gRPC holds the calls that arrive while the event loop is busy in a queue of its own until the loop asks
        for the next one, and `server.stop` cancels every call still queued: the client sees CANCELLED, which it
        does not retry. This wait lets the loop take the queued calls in, so that the service answers each with
        its own status (a stopping executor: UNAVAILABLE, retried on another replica). The quiet spell counts
        from now at the earliest, since queued calls are invisible until taken in; `longest` bounds the wait for
        clients that never stop sending."""
        start = time.monotonic()
        deadline = start + longest
        while True:
            left = min(max(start, self.metrics.last_call_at) + quiet, deadline) - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(left)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING first (load balancers drain), then finish in-flight RPCs within `grace`."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def create_server(
    settings: ServerSettings,
    service_label: str,
    extra_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, RpcMetrics]:
    """The server with its interceptors: metrics and error mapping outermost, so that it counts the token
    check's refusals, then the token check (when a token is configured), then `extra_interceptors`.
    `max_request_bytes`: the largest valid request of the service (--max-message-bytes overrides it)."""
    token = resolve_token(settings.auth_token, settings.auth_token_file)
    auth = [TokenAuthInterceptor(token)] if token else []
    metrics = RpcMetrics(service_label)
    server = grpc.aio.server(
        interceptors=[ObservingInterceptor(metrics), *auth, *extra_interceptors],
        options=server_options(settings, max_request_bytes),
    )
    return server, metrics


async def start_server(
    server: grpc.aio.Server,
    metrics: RpcMetrics,
    settings: ServerSettings,
    services: Sequence[str],
    ready: bool = False,
) -> RunningServer:
    """Add health and reflection, bind, start. Health says SERVING if `ready`, else NOT_SERVING until
    the caller flips it (an executor, once its model is loaded and warm)."""
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    credentials = server_credentials(settings)
    check_bindable(settings.host, settings.port)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # "Failed to bind to address": taken between the check and here
        port = 0
    if port == 0:
        raise OSError(f"cannot bind {address}: in use, or not an address of this machine")
    metrics_port = (
        metrics.serve_http(settings.metrics_host, settings.metrics_port) if settings.metrics_port >= 0 else None
    )
    await server.start()
    running = RunningServer(server, health_servicer, port, metrics, metrics_port, tuple(services))
    await running.set_serving(ready)
    if settings.port_file:
        Path(settings.port_file).write_text(f"{port}\n")
    log.info(
        "serving",
        extra={
            "address": f"{settings.host}:{port}",
            "tls": credentials is not None,
            "mtls": bool(settings.tls_client_ca),
            "auth_token": bool(settings.auth_token or settings.auth_token_file),
            "metrics_port": metrics_port,
        },
    )
    return running


async def wait_for_termination_signal() -> None:
    """Return on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")

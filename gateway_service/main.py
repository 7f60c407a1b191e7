"""`specdec-gateway`: serve the OpenAI HTTP API (chat completions, completions, models) in front of specdec
executors, until SIGTERM. A client of the executors over gRPC; it holds no model and no state worth losing.

    specdec-gateway --port 8000 --executor dns:///executor:50052

Every flag is also SPECDEC_<FLAG> (--executor: SPECDEC_EXECUTOR), as for the other servers."""

from __future__ import annotations

import gateway_service.grpc_io  # noqa: F401  (first: it imports grpc, with the client I/O the gateway uses)

# isort: split
import argparse
import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from gateway_service.app import Gateway, GatewayConfig
from gateway_service.body import DEFAULT_MAX_BODY_BYTES
from gateway_service.caller_auth import CallerAuth
from gateway_service.upstream import Upstream
from specdec_runtime.auth import resolve_token
from specdec_runtime.client import server_address
from specdec_runtime.grpc_runtime import (
    EXIT_BAD_SETUP,
    EnvDefaultsParser,
    ServerSettings,
    add_server_arguments,
    check_bindable,
    env_name,
    server_credentials,
)
from specdec_runtime.logs import configure_logging

DEFAULT_PORT = 8000
PARENT_CHECK_S = 1.0  # how often a worker looks for its supervisor
log = logging.getLogger("specdec.gateway")
# The shared server flags, as they read for an HTTP server.
HTTP_HELP = {
    "--port": "HTTP port (0: any free port)",
    "--tls-cert": "PEM server certificate; with --tls-key, serve HTTPS",
    "--auth-token": "shared token: every /v1 request needs 'Authorization: Bearer <token>' (/health and /metrics "
    "stay open); also sent to the executors unless --executor-auth-token is given",
    "--max-message-bytes": f"largest request body (default {DEFAULT_MAX_BODY_BYTES}); larger ones get 413 before "
    "they are read",
    "--grace-seconds": "on SIGTERM, how long running generations may go on before they are cut",
    "--port-file": "write the bound HTTP port here once the server answers (for --port 0)",
}


def parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="specdec-gateway", description=__doc__)
    add_server_arguments(parser, DEFAULT_PORT)
    for action in parser._actions:
        for flag in set(action.option_strings) & HTTP_HELP.keys():
            action.help = f"{HTTP_HELP[flag]} [env {env_name(flag)}]"
    parser.add_argument(
        "--executor",
        type=server_address,
        default="127.0.0.1:50052",
        help="the executors' gRPC target: HOST:PORT, or dns:///name:port for every replica behind a name",
    )
    parser.add_argument("--executor-tls-ca", help="PEM CA that signed the executors' certificate (enables TLS)")
    parser.add_argument("--executor-tls-cert", help="PEM client certificate for the executors (mTLS)")
    parser.add_argument("--executor-tls-key", help="PEM client key for the executors (mTLS)")
    parser.add_argument("--executor-tls-server-name", help="the executors' expected name, if not the target's host")
    parser.add_argument("--executor-auth-token", help="token sent to the executors (default: --auth-token's)")
    parser.add_argument("--executor-auth-token-file", help="read --executor-auth-token from this file")
    parser.add_argument(
        "--served-model-name", default="specdec", help="the model id of /v1/models, which requests name"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=0.0, help="deadline of one generation in seconds (0: none)"
    )
    parser.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="auto: uvloop when installed (the gateway-fast extra), else asyncio's",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="HTTP worker processes sharing the port (SO_REUSEPORT: the kernel spreads connections over them), each "
        "with its own event loop and gRPC channel; /metrics adds every worker's up (default 1: one process)",
    )
    parser.add_argument(
        "--http-parser",
        choices=("auto", "h11", "httptools"),
        default="auto",
        help="uvicorn's HTTP/1.1 implementation; auto: httptools when installed (the gateway-fast extra), else h11",
    )
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def event_loop(choice: str) -> str:
    """The event loop to serve on: uvloop (libuv; a third less CPU per streamed event than asyncio's) when asked
    for or, with auto, installed; ValueError when asked for and not installed."""
    if choice == "auto":
        return "uvloop" if _installed("uvloop") else "asyncio"
    if not _installed(choice):
        raise ValueError(f"--event-loop {choice}: {choice} is not installed (pip install 'specdec[gateway-fast]')")
    return choice


def http_parser(choice: str) -> str:
    """uvicorn's HTTP implementation: httptools (llhttp, C) when asked for or, with auto, installed, else h11."""
    if choice == "auto":
        return "httptools" if _installed("httptools") else "h11"
    if not _installed(choice):
        raise ValueError(f"--http-parser {choice}: {choice} is not installed (pip install 'specdec[gateway-fast]')")
    return choice


def build_gateway(args: argparse.Namespace, multiprocess_dir: str | None = None) -> Gateway:
    """The app from the flags; ValueError for a bad token or TLS file (checked here, before serving).
    `multiprocess_dir`: one of --workers, whose metrics are kept there (metrics.py)."""
    token, executor_token = tokens(args)
    config = GatewayConfig(
        model_name=args.served_model_name,
        max_body_bytes=args.max_message_bytes or DEFAULT_MAX_BODY_BYTES,
        auth=CallerAuth(token),
        make_upstream=lambda: Upstream(args, executor_token or token),
    )
    return Gateway(config, multiprocess_dir)


def tokens(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The gateway's token and the executors' (from the flags or their files); ValueError for a bad one."""
    token = resolve_token(args.auth_token, args.auth_token_file)
    return token, resolve_token(args.executor_auth_token, args.executor_auth_token_file, "--executor-auth-token")


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket, with TCP_NODELAY, which Linux hands on to every accepted connection. asyncio
    sets it on a connection only when the socket says it is TCP (proto 6), and a socket made here says 0, so
    without it each response's small writes waited for the client's delayed ACK: +40 ms on a request's first
    token (measured on the CPU: the gateway added 43.5 ms to a lone stream's first token, 1.7 ms with it).
    `reuse_port`: SO_REUSEPORT, so that each of --workers listens on a socket of its own on the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, reuse_port=reuse_port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def check_setup(args: argparse.Namespace) -> tuple[bool, str]:
    """The flags' combinations and PEM files, the event loop and HTTP parser asked for (ValueError when not
    installed), checked before anything serves: whether it serves TLS, and the HTTP parser."""
    settings = ServerSettings.from_args(args)
    tls = server_credentials(settings) is not None  # checks the PEM files and flag combinations as the servers do
    event_loop(args.event_loop)
    return tls, http_parser(args.http_parser)


@dataclass
class Worker:
    """One of --workers: its number, its listening socket (the supervisor's), a function that tells the
    supervisor it serves, and the supervisor's pid (the worker stops if its parent goes away)."""

    index: int
    sock: socket.socket
    serving: Callable[[], None]
    parent: int
    metrics_dir: str


async def serve(args: argparse.Namespace, worker: Worker | None = None) -> None:
    tls, http = check_setup(args)
    gateway = build_gateway(args, worker.metrics_dir if worker else None)
    if worker is None:
        check_bindable(args.host, args.port)
        sock = listening_socket(args.host, args.port)
    else:
        sock = worker.sock
    config = uvicorn.Config(
        gateway.app(),
        http=http,
        log_config=None,
        access_log=False,  # a log record per request is CPU the executors' callers wait on; /metrics counts them
        timeout_graceful_shutdown=max(int(args.grace_seconds), 1),
        ssl_certfile=args.tls_cert if tls else None,
        ssl_keyfile=args.tls_key if tls else None,
        ssl_ca_certs=args.tls_client_ca if tls else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and args.tls_client_ca else ssl.CERT_NONE,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    if args.metrics_port >= 0 and worker is None:  # the supervisor serves every worker's
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=gateway.metrics.registry)
    announce = asyncio.ensure_future(_announce(server, sock, args, tls, http, worker))
    try:
        await server.serve(sockets=[sock])
    finally:
        announce.cancel()
    log.info("stopped", extra={"worker": worker.index} if worker else None)


class _Server(uvicorn.Server):
    """uvicorn's server, minus its signal handling: it raises a caught SIGTERM again once stopped, so the
    process would die of it; here SIGTERM stops the server and the process exits 0, as the other servers do."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _announce(
    server: uvicorn.Server, sock: socket.socket, args: argparse.Namespace, tls: bool, http: str, worker: Worker | None
) -> None:
    """Once uvicorn serves: the log line and the port file, or for a worker, word to the supervisor (which logs
    and writes them once every worker serves); then a worker watches that its supervisor is still there."""
    while not server.started:
        await asyncio.sleep(0.02)
    port = sock.getsockname()[1]
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    where = {"address": f"{args.host}:{port}", "tls": tls, "executor": args.executor, "loop": loop, "http": http}
    if worker is not None:
        log.debug("worker serving", extra={**where, "worker": worker.index})
        worker.serving()
        while os.getppid() == worker.parent:  # a supervisor killed outright leaves no worker behind
            await asyncio.sleep(PARENT_CHECK_S)
        log.warning("the supervisor went away: stopping", extra={"worker": worker.index})
        server.should_exit = True
        return
    log.info("serving", extra=where)
    if args.port_file:
        Path(args.port_file).write_text(f"{port}\n")


def run(args: argparse.Namespace, worker: Worker | None = None) -> int:
    """Serve until SIGTERM in the event loop --event-loop asks for: the process's exit status."""
    try:
        loop_factory = None
        if event_loop(args.event_loop) == "uvloop":
            import uvloop

            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(args, worker))
    except (OSError, ValueError) as err:  # address in use, a TLS key that is not the certificate's, ...
        log.error("cannot serve: %s", err)
        return EXIT_BAD_SETUP
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.workers > 1:
        from gateway_service.workers import supervise

        return supervise(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Container health probe for the specdec servers: one grpc.health.v1 Check against this container's server.

Exit 0 when the server answers SERVING (or NOT_SERVING too, with --allow-not-serving: an executor that is up
but has no model loaded yet), else print why on stderr and exit 1 (Docker's "unhealthy").

It reads the server's own settings from the environment the server reads them from, so a compose file needs
no arguments: SPECDEC_PORT, SPECDEC_HOST (a wildcard address means localhost), SPECDEC_TLS_CERT (the server
serves TLS) and SPECDEC_TLS_CLIENT_CA (it wants client certificates). The probe's own TLS settings mirror the
`specdec` client's flags: SPECDEC_HEALTHCHECK_TLS_CA (the CA that signed the server's certificate, or that
certificate itself if self-signed), SPECDEC_HEALTHCHECK_TLS_CERT and _TLS_KEY (mTLS), _TLS_SERVER_NAME (the
certificate's name, if not the host). Health needs no auth token: the servers leave grpc.health.v1 open.
Only grpcio and grpcio-health-checking are needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
TRUE = {"1", "true", "yes", "on"}


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> argparse.Namespace:
    def probe_env(name: str) -> str | None:
        return env.get(f"SPECDEC_HEALTHCHECK_{name}") or None

    server_host = env.get("SPECDEC_HOST", "")
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="localhost" if server_host in WILDCARDS else server_host)
    parser.add_argument("--port", type=int, default=env.get("SPECDEC_PORT") or None, help="[env SPECDEC_PORT]")
    parser.add_argument("--service", default=probe_env("SERVICE") or "", help="health service name ('': the server)")
    parser.add_argument("--timeout", type=float, default=float(probe_env("TIMEOUT") or 3.0), help="seconds")
    parser.add_argument(
        "--allow-not-serving",
        action="store_true",
        default=(probe_env("ALLOW_NOT_SERVING") or "0").lower() in TRUE,
        help="NOT_SERVING passes too: the server is up (an executor waiting for LoadModel)",
    )
    parser.add_argument("--tls-ca", default=probe_env("TLS_CA"), help="PEM CA that signed the server certificate")
    parser.add_argument("--tls-cert", default=probe_env("TLS_CERT"), help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", default=probe_env("TLS_KEY"), help="PEM client key (mTLS)")
    parser.add_argument("--tls-server-name", default=probe_env("TLS_SERVER_NAME"), help="expected certificate name")
    args = parser.parse_args(argv)
    if args.port is None:
        parser.error("no port: pass --port or set SPECDEC_PORT")
    args.server_tls_cert = env.get("SPECDEC_TLS_CERT") or None
    args.server_wants_client_cert = bool(env.get("SPECDEC_TLS_CLIENT_CA"))
    return args


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plain, TLS or mTLS, matching what the server was started with."""
    address = f"{args.host}:{args.port}"
    if args.server_tls_cert and not args.tls_ca:
        raise ValueError(
            "the server serves TLS (SPECDEC_TLS_CERT): set SPECDEC_HEALTHCHECK_TLS_CA to the CA that signed its "
            "certificate (a self-signed certificate is its own CA)"
        )
    if not args.tls_ca:
        if args.tls_cert or args.tls_key:
            raise ValueError("a client certificate needs SPECDEC_HEALTHCHECK_TLS_CA (--tls-ca) too")
        return grpc.insecure_channel(address)
    if args.server_wants_client_cert and not (args.tls_cert and args.tls_key):
        raise ValueError(
            "the server requires client certificates (SPECDEC_TLS_CLIENT_CA): "
            "set SPECDEC_HEALTHCHECK_TLS_CERT and SPECDEC_HEALTHCHECK_TLS_KEY"
        )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes(),
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(args: argparse.Namespace) -> str | None:
    """None when healthy, else the reason."""
    passing = {health_pb2.HealthCheckResponse.SERVING}
    if args.allow_not_serving:
        passing.add(health_pb2.HealthCheckResponse.NOT_SERVING)
    with open_channel(args) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as err:
            return f"{args.host}:{args.port}: {err.code().name}: {err.details()}"  # type: ignore[attr-defined]
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return None if response.status in passing else f"{args.host}:{args.port} {args.service!r} is {status}"


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    try:
        args = parse_args(argv, os.environ if env is None else env)
    except SystemExit as exit_:  # argparse's usage errors exit 2, which Docker reserves: report them as 1
        return 0 if exit_.code == 0 else 1
    try:
        problem = check(args)
    except (OSError, ValueError) as err:  # an unreadable certificate, a client certificate missing
        problem = str(err)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

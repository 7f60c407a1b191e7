"""Client-side helpers: channels (plain, TLS, mTLS, with or without a bearer token) and loading a request from a
YAML/JSON file.

Every blocking channel (the CLI's, the demo's) balances with gRPC's own round_robin over the addresses its target
resolves to (`dns:///name:port` behind a Kubernetes headless service, `ipv4:host1:p1,host2:p2`), and retries a call
that ends UNAVAILABLE before any response arrived (a replica down or shutting down) on the next one: SERVICE_CONFIG."""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from specdec_runtime.auth import BearerTokenClientInterceptor, aio_bearer_interceptors

# Calls that are safe to send again when they failed UNAVAILABLE before any response: the read-only ones, the
# selector's pure function, and Generate. gRPC commits a call at its first response message (the executor sends
# its headers with the first tokens), so a Generate is retried only while it has produced no tokens: a replica
# killed mid-stream ends that stream UNAVAILABLE, never repeats tokens. LoadModel and Abort act on one replica and
# are never retried here.
RETRIED_METHODS = (
    {"service": "specdec.v1.BackendSelector"},
    *(
        {"service": "specdec.v1.Executor", "method": method}
        for method in ("Generate", "GetCapabilities", "GetModelInfo", "GetServerInfo", "GetLoads")
    ),
)
RETRY_POLICY = {
    "maxAttempts": 5,  # gRPC's ceiling; round_robin picks the next replica for each attempt
    "initialBackoff": "0.02s",  # short: the next attempt goes to another replica, not back to a busy one
    "maxBackoff": "0.2s",  # five attempts fail within about half a second when nothing answers at all
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{"name": list(RETRIED_METHODS), "retryPolicy": RETRY_POLICY}],
    }
)
# round_robin and the retries above, whatever service config a DNS TXT record might carry.
BALANCING_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.service_config_disable_resolution", 1),
    ("grpc.enable_retries", 1),
)


def open_channel(
    address: str,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    server_name: str | None = None,
    auth_token: str | None = None,
) -> grpc.Channel:
    """A blocking channel; TLS when a CA is given, mTLS when a client certificate and key are too; every call
    carries `authorization: Bearer <auth_token>` when a token is given."""
    token = BearerTokenClientInterceptor(auth_token) if auth_token else None  # a bad token fails before connecting
    credentials, security = channel_security(tls_ca, tls_cert, tls_key, server_name)
    options = [*BALANCING_OPTIONS, *security]
    channel = (
        grpc.secure_channel(address, credentials, options=options)
        if credentials
        else grpc.insecure_channel(address, options=options)
    )
    return grpc.intercept_channel(channel, token) if token else channel


def resolved_addresses(target: str) -> list[str]:
    """The HOST:PORT addresses a gRPC target stands for now: every replica behind `dns:///name:port` (a headless
    service, a scaled compose service) or `ipv4:a:p,b:p`; a unix: target as is. For asking each replica on its
    own (`specdec loads --each`); calls themselves go through the balanced channel. No port: gRPC's 443."""
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return [address for address in rest.split(",") if address]
    if scheme in ("unix", "unix-abstract", "vsock"):
        return [target]
    if scheme == "dns":  # dns:host:port, dns:///host:port or dns://authority/host:port
        rest = rest.removeprefix("//")
        name = rest.split("/", 1)[1] if "/" in rest else rest
    else:
        name = target
    if name.startswith("["):  # [v6]:port
        host, _, port = name[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = name.rpartition(":") if name.count(":") == 1 else (name, "", "")
    found = socket.getaddrinfo(host, int(port or 443), type=socket.SOCK_STREAM)
    addresses = [f"[{ip}]:{number}" if ":" in ip else f"{ip}:{number}" for *_, (ip, number, *_) in found]
    return list(dict.fromkeys(addresses))


def server_address(text: str) -> str:
    """An argparse type for HOST:PORT flags: a port outside 1..65535 is refused at parse time (gRPC would
    otherwise take 99999 modulo 65536 and dial 34463). Other gRPC targets (unix:..., dns:///...) pass as is."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return text
    if host and not host.endswith(":") and not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: {number} is not a port in 1..65535")
    return text


def add_channel_arguments(parser: argparse.ArgumentParser, whom: str = "the server") -> None:
    """The TLS / mTLS / token flags of a client reaching `whom` (read back by `open_channel_from_args`)."""
    parser.add_argument("--tls-ca", help=f"PEM CA that signed the certificate of {whom} (enables TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", help="PEM client key (mTLS)")
    parser.add_argument("--tls-server-name", help=f"expected name of {whom}, if not the address's host")
    parser.add_argument(
        "--auth-token",
        default=os.environ.get("SPECDEC_AUTH_TOKEN"),
        help=f"send 'authorization: Bearer <token>' to {whom} with every call [env SPECDEC_AUTH_TOKEN]",
    )


def open_channel_from_args(address: str, args: argparse.Namespace) -> grpc.Channel:
    """open_channel with the flags of `add_channel_arguments`."""
    tls = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    return open_channel(address, *tls, auth_token=args.auth_token)


def open_aio_channel(
    address: str,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    server_name: str | None = None,
    auth_token: str | None = None,
    flags: str = "--tls",
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """open_channel for grpc.aio (unary and server-streaming calls), e.g. the executor's selector client;
    `flags` names the TLS flags in errors; `options`: more channel options (reconnect backoff, ...). Create it
    inside the event loop that uses it."""
    interceptors = aio_bearer_interceptors(auth_token) if auth_token else None
    credentials, security = channel_security(tls_ca, tls_cert, tls_key, server_name, flags)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=[*security, *options], interceptors=interceptors)


def channel_security(
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    server_name: str | None,
    flags: str = "--tls",
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """The channel credentials (None: plaintext) and options for these PEM files; reads them now, so a missing
    file fails when the channel is made. `flags` is the flags' prefix, for the errors."""
    if not tls_ca:
        if tls_cert or tls_key or server_name:
            raise ValueError(f"{flags}-cert, {flags}-key and {flags}-server-name need {flags}-ca too")
        return None, []
    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"a client certificate needs both {flags}-cert and {flags}-key (mTLS)")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )
    return credentials, [("grpc.ssl_target_name_override", server_name)] if server_name else []


def load_message(path: str, message: Message) -> Message:
    """Fill `message` from a YAML or JSON file in the protobuf JSON mapping (enum names as strings). Every way the
    file can be wrong (unreadable, malformed YAML or JSON, a field the message lacks) is a ValueError or OSError
    of one line naming the file, which callers print as is (no traceback)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    try:
        return json_format.ParseDict(data, message)
    except json_format.ParseError as err:
        raise ValueError(f"{path}: {' '.join(str(err).split())}") from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error on one line: the problem and where (its str() spans several lines, with a caret)."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        context = f"{err.context}, " if err.context else ""
        return f"{context}{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())

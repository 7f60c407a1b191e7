"""Optional shared-token authentication for both specdec gRPC services (torch-free).

A server started with a token (--auth-token or --auth-token-file) answers every call that lacks the
metadata `authorization: Bearer <token>` with UNAUTHENTICATED, except the gRPC health service: container
and load-balancer probes speak only the standard Health protocol, without credentials, and health reveals
nothing but SERVING / NOT_SERVING. Tokens are compared in constant time and never echoed or logged.

The header is read strictly: one `authorization` entry, the scheme `Bearer` (in any case, as RFC 7235 has
it), one space, the token, nothing around them. Anything looser would accept values that proxies and other
servers read differently.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import namedtuple
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
SCHEME = "Bearer"
# Services callable without a token: the health probe (grpc.health.v1.Health/Check and /Watch).
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})


def check_token(token: str, origin: str) -> str:
    """`token` if it can travel in gRPC metadata (printable ASCII, no spaces), else ValueError naming `origin`."""
    if not token:
        raise ValueError(f"{origin}: the auth token is empty")
    if not all(0x21 <= ord(char) <= 0x7E for char in token):
        raise ValueError(f"{origin}: the auth token must be printable ASCII without spaces")
    return token


def resolve_token(token: str | None, token_file: str | None, flag: str = "--auth-token") -> str | None:
    """The token from `flag` or `flag`-file (one, not both; `flag` names them in errors, e.g. the executor's
    --selector-auth-token); None: no token. A file's surrounding whitespace (its trailing newline) is not
    part of the token."""
    if token and token_file:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if token_file:
        return check_token(Path(token_file).read_text().strip(), f"{flag}-file {token_file}")
    if token:
        return check_token(token, flag)
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str]]:
    """The metadata that authenticates one call, for clients that pass metadata per call."""
    return ((METADATA_KEY, f"{SCHEME} {token}"),)


def _presented(metadata: Any) -> list[str]:
    """Every `authorization` value the call carries."""
    return [
        value if isinstance(value, str) else value.decode("ascii", "replace")
        for key, value in metadata or ()
        if key == METADATA_KEY
    ]


def _digest(token: str | bytes) -> bytes:
    """Compared instead of the tokens themselves: equal lengths, so the comparison leaks not even the length."""
    return hashlib.sha256(token if isinstance(token, bytes) else token.encode("utf-8", "replace")).digest()


def _well_formed(token: str) -> bool:
    """A token as check_token allows: printable ASCII, no spaces (so no whitespace around it either)."""
    return bool(token) and all(0x21 <= ord(char) <= 0x7E for char in token)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token before their handler (or request parsing) runs. Placed
    after the observing interceptor, so refusals are counted in specdec_rpc_requests{code="UNAUTHENTICATED"}."""

    def __init__(self, token: str) -> None:
        self._expected = _digest(check_token(token, "auth token"))

    def problem(self, metadata: Any) -> str | None:
        """Why the call's metadata does not authenticate it; None when it does."""
        values = _presented(metadata)
        if not values:
            return f"missing '{METADATA_KEY}' metadata: this server requires '{METADATA_KEY}: {SCHEME} <token>'"
        if len(values) > 1:
            return f"{len(values)} '{METADATA_KEY}' metadata entries: send exactly one, '{SCHEME} <token>'"
        scheme, _, presented = values[0].partition(" ")
        if scheme.lower() != SCHEME.lower() or not _well_formed(presented):
            return f"the '{METADATA_KEY}' metadata must read '{SCHEME} <token>'"
        if not hmac.compare_digest(_digest(presented), self._expected):
            return "invalid bearer token"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        problem = self.problem(handler_call_details.invocation_metadata)
        return handler if problem is None else _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED. It takes the request as raw
    bytes (no deserializer), so an unauthenticated caller learns nothing about the request's validity."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached (abort raises); it makes this an async generator, as streaming handlers are

    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, response_serializer=serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, response_serializer=serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=serializer)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, response_serializer=serializer)


class _CallDetails(
    namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    """A call's details with changed metadata (grpc.ClientCallDetails is an interface without a constructor)."""


class BearerTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a blocking channel, plain or TLS (call
    credentials would need TLS)."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(check_token(token, "auth token"))

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        kept = tuple((key, value) for key, value in details.metadata or () if key != METADATA_KEY)
        return _CallDetails(
            details.method,
            details.timeout,
            kept + self._metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request_iterator)


class _AioBearerToken:
    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(check_token(token, "auth token"))

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        kept = [(key, value) for key, value in details.metadata or () if key != METADATA_KEY]
        return details._replace(metadata=grpc.aio.Metadata(*kept, *self._metadata))


class _AioUnaryUnaryBearerToken(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request)


class _AioUnaryStreamBearerToken(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request)


def aio_bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `authorization: Bearer <token>` to the unary and server-streaming calls of a grpc.aio
    channel (the executor's selector client; the specdec services have no client-streaming methods). One per
    call kind: grpc.aio files an interceptor under the first kind it implements only."""
    return [_AioUnaryUnaryBearerToken(token), _AioUnaryStreamBearerToken(token)]

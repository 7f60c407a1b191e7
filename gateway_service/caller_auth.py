"""The HTTP caller's bearer token (`Authorization: Bearer <token>`), read as strictly as the gRPC servers read
theirs: with a gateway token configured, the same constant-time check (specdec_runtime.auth) answers a missing or
wrong token 401 before any executor is called; without one, a token the caller sends is passed through."""

from __future__ import annotations

from collections.abc import Iterable

from gateway_service.errors import ApiError
from specdec_runtime.auth import METADATA_KEY, SCHEME, TokenAuthInterceptor, check_token

HEADER = METADATA_KEY.encode("latin-1")  # "authorization", as ASGI servers give header names: lower case


class CallerAuth:
    def __init__(self, token: str | None) -> None:
        self._check = TokenAuthInterceptor(token) if token else None

    def token(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The caller's token from the request's ASGI headers (scope["headers"]; None: none sent); ApiError 401
        when it does not authenticate the caller."""
        values = [value.decode("latin-1") for name, value in headers if name == HEADER]
        if self._check is not None:
            problem = self._check.problem([(METADATA_KEY, value) for value in values])
            if problem is not None:
                raise ApiError(401, problem.replace("metadata", "header"), code="invalid_api_key")
        if not values:
            return None
        scheme, _, token = values[0].partition(" ")
        try:
            if len(values) > 1 or scheme.lower() != SCHEME.lower():
                raise ValueError
            return check_token(token, "the caller")  # what gRPC metadata can carry on to the executors
        except ValueError:
            message = f"the Authorization header must read '{SCHEME} <token>'"
            raise ApiError(401, message, code="invalid_api_key") from None

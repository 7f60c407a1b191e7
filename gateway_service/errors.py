"""Errors as the OpenAI API shapes them (`{"error": {"message", "type", "param", "code"}}`), with the HTTP status
that matches the executor's gRPC status, so that OpenAI SDKs raise the exception class a caller expects
(BadRequestError, AuthenticationError, RateLimitError, ...) and retry only what is worth retrying.

Every text that may echo a caller's value is clipped (specdec_runtime.errors.clip) before it is sent back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from starlette.responses import JSONResponse

from specdec_runtime.errors import MAX_MESSAGE, MAX_NAME, clip

# google.rpc's HTTP mapping (google/rpc/code.proto), which the table follows.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's `type` for each HTTP status; anything else is a server error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered as OpenAI's JSON error object with `status`; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        self.status = status
        self.message = clip(message, MAX_MESSAGE)
        self.param = clip(param, MAX_NAME) if param else None
        self.code = code
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        error_type = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_field(param: str, message: str) -> ApiError:
    """400 naming the request field."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_rpc_error(err: grpc.RpcError, param_for: Callable[[str], str | None]) -> ApiError:
    """The ApiError for an executor's status; `param_for` turns a gRPC field path of the first BadRequest
    violation (`sampling.max_tokens`) into the OpenAI request's (`max_tokens`).

    RESOURCE_EXHAUSTED naming a field (prompt + max_tokens larger than the KV cache) is the request's own fault
    and never fits however often it is sent: 400 `context_length_exceeded`, not 429, which SDKs retry."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (err.details() if callable(getattr(err, "details", None)) else None) or code.name
    field = _first_bad_field(err)
    param = param_for(field) if field else None
    status = HTTP_STATUS.get(code, 500)
    error_code = code.name.lower()
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and field:
        status, error_code = 400, "context_length_exceeded"
    return ApiError(status, message, param=param, code=error_code)


def _first_bad_field(err: grpc.RpcError) -> str | None:
    """The field of the status's first BadRequest violation (google.rpc details), if any."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (AttributeError, ValueError, TypeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad) and bad.field_violations:
            return bad.field_violations[0].field
    return None

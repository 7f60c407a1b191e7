"""Errors that carry their gRPC status and google.rpc details, so every service reports bad input alike.

Raised by pure code (selection, request checks) and turned into a rich status only at the RPC edge.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    field: str  # dotted path in the request, e.g. "target_layers.head_size"
    description: str


@dataclass(frozen=True)
class PreconditionViolation:
    type: str  # e.g. "BACKEND"
    subject: str  # e.g. "FLASH_ATTN"
    description: str


class SpecdecError(Exception):
    """An error with a gRPC status code and optional google.rpc details."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        field_violations: tuple[FieldViolation, ...] = (),
        precondition_violations: tuple[PreconditionViolation, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field_violations = tuple(field_violations)
        self.precondition_violations = tuple(precondition_violations)

    def fresh(self) -> SpecdecError:
        """A new instance with the same status: raising one shared instance again and again would grow
        its __traceback__ (and keep every raising frame alive)."""
        return type(self)(self.message, self.field_violations, self.precondition_violations)

    def to_status(self) -> grpc.Status:
        """The grpc.Status (code, message, google.rpc.Status details) for context.abort_with_status."""
        return rpc_status.to_status(self.status_proto())

    def status_proto(self) -> status_pb2.Status:
        """The google.rpc.Status: code, message and the BadRequest / PreconditionFailure details."""
        details = []
        if self.field_violations:
            bad_request = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                    for v in self.field_violations
                ]
            )
            details.append(_pack(bad_request))
        if self.precondition_violations:
            failure = error_details_pb2.PreconditionFailure(
                violations=[
                    error_details_pb2.PreconditionFailure.Violation(
                        type=v.type, subject=v.subject, description=v.description
                    )
                    for v in self.precondition_violations
                ]
            )
            details.append(_pack(failure))
        return status_pb2.Status(code=_CODES[self.code], message=self.message, details=details)


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unimplemented(SpecdecError):
    code = grpc.StatusCode.UNIMPLEMENTED


def invalid_fields(violations: list[FieldViolation]) -> InvalidArgument:
    """One INVALID_ARGUMENT for every bad field found, so callers fix them all in one round trip."""
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
    return InvalidArgument(f"invalid request: {summary}", field_violations=tuple(violations))


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


_CODES = {code: getattr(code_pb2, code.name) for code in grpc.StatusCode}

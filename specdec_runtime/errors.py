"""Errors that carry their gRPC status and google.rpc details, so every service reports bad input alike.

Raised by pure code (selection, request checks) and turned into a rich status only at the RPC edge.

Every text an error carries is clipped here, once for all callers: messages and details echo the caller's
input, and the status travels in gRPC trailers (`grpc-message`, percent-encoded, and `grpc-status-details-bin`,
base64), which clients refuse beyond 8 KiB in all. An error that echoed a 6 KB name would reach its caller as
RESOURCE_EXHAUSTED "metadata size exceeds limit" instead of itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

# Limits in wire bytes (see `wire_length`), chosen so that the whole status stays far below 8 KiB of trailers:
# the message at most 1 KiB in grpc-message, the google.rpc.Status at most STATUS_BUDGET before base64.
MAX_MESSAGE = 1024
MAX_NAME = 128  # a field path, a violation's type or subject
MAX_DESCRIPTION = 256
MAX_VIOLATIONS = 32  # kept per error; the status carries those that fit STATUS_BUDGET
STATUS_BUDGET = 4096
ECHO_CHARS = 64  # what `echo` shows of a caller's value
# Bytes that grpc-message percent-encodes (%XX: three bytes each): controls, '%' and everything past ASCII.
_ENCODED = bytes([*range(0x20), 0x25, *range(0x7F, 0x100)])


def wire_length(text: str) -> int:
    """The length of `text` in grpc-message: its UTF-8 bytes, three for each one that is percent-encoded."""
    data = text.encode("utf-8", "replace")
    return len(data) + 2 * (len(data) - len(data.translate(None, _ENCODED)))


def clip(text: str, limit: int) -> str:
    """`text` if its wire length is at most `limit`; else its head and tail around a note of how much was cut,
    within `limit` (the tail usually holds the rest of the sentence an echoed value interrupted)."""
    if len(text) <= limit // 9 or wire_length(text) <= limit:  # the first test: 9 wire bytes per char at most
        return text
    note = f" ...[{len(text)} characters, cut]... "
    room = max(limit - len(note), 0)
    head = _fit(text[:room], room * 3 // 4)
    tail = _fit(text[-(room // 4) :][::-1], room - wire_length(head))[::-1] if room >= 4 else ""
    return head + note + tail


def _fit(text: str, limit: int) -> str:
    """The longest prefix of `text` whose wire length is at most `limit`."""
    while text and (excess := wire_length(text) - limit) > 0:
        text = text[: -max(1, excess // 12)]  # a character is 12 wire bytes at most: never cuts too much
    return text


def echo(value: str, limit: int = ECHO_CHARS) -> str:
    """`value` quoted for a message: repr(value), or for a long one its start and its length."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


@dataclass(frozen=True)
class FieldViolation:
    field: str  # dotted path in the request, e.g. "target_layers.head_size"
    description: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", clip(self.field, MAX_NAME))
        object.__setattr__(self, "description", clip(self.description, MAX_DESCRIPTION))


@dataclass(frozen=True)
class PreconditionViolation:
    type: str  # e.g. "BACKEND"
    subject: str  # e.g. "FLASH_ATTN"
    description: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", clip(self.type, MAX_NAME))
        object.__setattr__(self, "subject", clip(self.subject, MAX_NAME))
        object.__setattr__(self, "description", clip(self.description, MAX_DESCRIPTION))


class SpecdecError(Exception):
    """An error with a gRPC status code and optional google.rpc details."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        field_violations: tuple[FieldViolation, ...] = (),
        precondition_violations: tuple[PreconditionViolation, ...] = (),
        omitted: int = 0,
    ) -> None:
        """`message` is clipped to MAX_MESSAGE and at most MAX_VIOLATIONS of each kind are kept; `omitted`
        counts violations a caller dropped already (see `fresh`)."""
        fields, preconditions = tuple(field_violations), tuple(precondition_violations)
        self.message = clip(message, MAX_MESSAGE)
        super().__init__(self.message)
        self.field_violations = fields[:MAX_VIOLATIONS]
        self.precondition_violations = preconditions[:MAX_VIOLATIONS]
        self.omitted = omitted + max(len(fields) - MAX_VIOLATIONS, 0) + max(len(preconditions) - MAX_VIOLATIONS, 0)

    def fresh(self) -> SpecdecError:
        """A new instance with the same status: raising one shared instance again and again would grow
        its __traceback__ (and keep every raising frame alive)."""
        return type(self)(self.message, self.field_violations, self.precondition_violations, self.omitted)

    def to_status(self) -> grpc.Status:
        """The grpc.Status (code, message, google.rpc.Status details) for context.abort_with_status."""
        return rpc_status.to_status(self.status_proto())

    def status_proto(self) -> status_pb2.Status:
        """The google.rpc.Status: code, message and the BadRequest / PreconditionFailure details, with as
        many violations (in order) as fit STATUS_BUDGET; the message says how many were left out."""
        status = status_pb2.Status(code=_CODES[self.code], message=self.message)
        bad_request = error_details_pb2.BadRequest()
        failure = error_details_pb2.PreconditionFailure()
        kept = 0
        for violation in (*self.field_violations, *self.precondition_violations):
            if isinstance(violation, FieldViolation):
                added = bad_request.field_violations
                added.add(field=violation.field, description=violation.description)
            else:
                added = failure.violations
                added.add(type=violation.type, subject=violation.subject, description=violation.description)
            if status.ByteSize() + bad_request.ByteSize() + failure.ByteSize() + 64 > STATUS_BUDGET:
                del added[-1]
                break
            kept += 1
        omitted = self.omitted + len(self.field_violations) + len(self.precondition_violations) - kept
        if omitted:
            note = f" ({omitted} more violations not shown)"
            status.message = clip(self.message, MAX_MESSAGE - len(note)) + note
        status.details.extend(_pack(d) for d in (bad_request, failure) if d.ByteSize())
        return status


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

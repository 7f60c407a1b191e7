"""The google.rpc details a refused call carries, read back the way a client reads them."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def field_violations(err: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The BadRequest field violations in the call's status details (none when it has no details)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    found: list[error_details_pb2.BadRequest.FieldViolation] = []
    for detail in status.details if status is not None else []:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            found.extend(bad_request.field_violations)
    return found


def violations(err: grpc.RpcError) -> dict[str, str]:
    """field -> description of each BadRequest field violation."""
    return {v.field: v.description for v in field_violations(err)}


def violated_fields(err: grpc.RpcError) -> list[str]:
    return [v.field for v in field_violations(err)]

"""The BackendSelector gRPC service: a thin async shell over the pure, cached selection."""

from __future__ import annotations

import grpc

from selection.catalog import PLATFORM_TO_PROTO, list_backends
from selection.selector import Selector
from specdec.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from specdec_runtime.errors import FieldViolation, SpecdecError, invalid_fields

SERVICE_NAME = selector_pb2.DESCRIPTOR.services_by_name["BackendSelector"].full_name


class BackendSelectorServicer(selector_pb2_grpc.BackendSelectorServicer):
    def __init__(self, selector: Selector) -> None:
        self._selector = selector

    async def SelectBackends(
        self, request: selector_pb2.SelectBackendsRequest, context: grpc.aio.ServicerContext
    ) -> selector_pb2.SelectBackendsResponse:
        try:
            return self._selector.select(request)
        except SpecdecError as err:
            await context.abort_with_status(err.to_status())
            raise  # unreachable: abort_with_status raises

    async def ListBackends(
        self, request: selector_pb2.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> selector_pb2.ListBackendsResponse:
        known = (common_pb2.PLATFORM_UNSPECIFIED, *PLATFORM_TO_PROTO.values())
        if request.platform not in known:
            err = invalid_fields([FieldViolation("platform", f"unknown platform {request.platform}")])
            await context.abort_with_status(err.to_status())
        return list_backends(request)

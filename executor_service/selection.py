"""Where the executor's backend decisions come from: the selector service (--selector-address) or the
same selection code in-process. Either way the input is one SelectBackendsRequest built from this
machine's capability report and the model's layer spec."""

from __future__ import annotations

import grpc

from selector_service.selection import Selector
from specdec.v1 import selector_pb2, selector_pb2_grpc

SELECT_TIMEOUT_SECONDS = 10.0


class BackendChooser:
    """`choose` returns the SelectBackendsResponse; raises SpecdecError (in-process) or AioRpcError
    (remote) with the selector's status and details, which LoadModel passes on unchanged."""

    def __init__(self, selector_address: str | None = None) -> None:
        self.selector_address = selector_address
        self._local = Selector(cache_size=64)
        self._channel: grpc.aio.Channel | None = None

    @property
    def remote(self) -> bool:
        return self.selector_address is not None

    async def choose(self, request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
        if self.selector_address is None:
            return self._local.select(request)
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.selector_address)
        stub = selector_pb2_grpc.BackendSelectorStub(self._channel)
        return await stub.SelectBackends(request, timeout=SELECT_TIMEOUT_SECONDS)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

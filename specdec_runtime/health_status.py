"""grpc.health.v1 for both servers: Check, and Watch streams that follow every status change.

grpc_health's asyncio servicer holds a per-service lock while it writes to a watcher (a client that stops
reading would hold up `set`, and so the executor's LoadModel), keeps one entry per watched name (any string
a caller sends), and never ends its Watch streams, so that they hold a stopping server for its whole grace
period. Here `set` never waits for a watcher, nothing is kept per watcher, and at shutdown every watcher is
sent NOT_SERVING and its stream ends (status OK): a client then sees the server go, not a cancelled call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_runtime.errors import echo

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The serving status of "" (the server) and of each registered service, for Check and Watch."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._changed = asyncio.Event()  # set, and replaced, on every change: watchers wait on the current one
        self._shutting_down = False

    def status(self, service: str) -> int:
        """The service's status; SERVICE_UNKNOWN for a name never set."""
        return self._status.get(service, SERVICE_UNKNOWN)

    async def set(self, service: str, status: int) -> None:
        """Set a service's status (ignored once shutdown has begun: it stays NOT_SERVING)."""
        if not self._shutting_down:
            self._update({service: status})

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; watchers get it, then their streams end."""
        if not self._shutting_down:
            self._shutting_down = True
            self._update(dict.fromkeys(self._status, NOT_SERVING))

    def _update(self, statuses: dict[str, int]) -> None:
        self._status.update(statuses)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {echo(request.service)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The current status at once, then each change (a status that flips and flips back between two
        looks may be missed: watchers want the latest status); the stream ends after shutdown's NOT_SERVING."""
        last = None
        while True:
            changed = self._changed  # taken before the status is read: a later change sets it
            status = self.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
                continue  # look again: the status may have changed (shutdown too) while the message was sent
            if self._shutting_down:
                return
            await changed.wait()

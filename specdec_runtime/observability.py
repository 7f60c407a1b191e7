"""One server interceptor for every service: Prometheus metrics per RPC, a log line per failure,
undecodable requests answered INVALID_ARGUMENT, and unexpected exceptions turned into INTERNAL (logged
with their traceback) instead of a bare UNKNOWN."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from specdec_runtime.errors import MAX_MESSAGE, clip

log = logging.getLogger("specdec.rpc")
LOGGED_DETAILS = 256  # of a failed RPC's status message, in its log line

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RpcMetrics:
    """The RPC counters and latency histogram of one server, in its own registry."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.service = service
        self.requests = Counter(
            "specdec_rpc_requests",
            "RPCs handled, by method and status code",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.errors = Counter(
            "specdec_rpc_errors",
            "RPCs that ended with a non-OK status",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "specdec_rpc_latency_seconds",
            "Time from receiving an RPC to its last response",
            ["service", "method"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        # time.monotonic() when the latest RPC came in (0: none yet): a stopping server waits for a quiet spell
        # before its final stop, which cancels the calls gRPC still holds (RunningServer.wait_until_quiet).
        self.last_call_at = 0.0

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.requests.labels(self.service, method, code.name).inc()
        if code is not grpc.StatusCode.OK:
            self.errors.labels(self.service, method, code.name).inc()
        self.latency.labels(self.service, method).observe(seconds)

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics on host:port (0: any free port); returns the bound port."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return httpd.server_port


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as err:
            return _Undecodable(err)

    return deserialize


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers; other kinds pass through untouched. A unary-stream
    handler either yields its responses (an async generator) or writes them with context.write and returns
    (grpc.health.v1's Watch): each is wrapped as what it is."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        self._metrics.last_call_at = time.monotonic()
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            wrap = self._wrap_stream if inspect.isasyncgenfunction(stream) else self._wrap_writer
            return grpc.unary_stream_rpc_method_handler(
                wrap(method, stream),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap_unary(self, method: str, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                await _refuse_undecodable(request, context)
                response = await behavior(request, context)
            except BaseException as err:
                await self._finish_failed(method, context, err, start)
                raise
            self._metrics.observe(method, context.code() or grpc.StatusCode.OK, time.perf_counter() - start)
            return response

        return observed

    def _wrap_stream(
        self, method: str, behavior: Callable[..., AsyncIterator[Any]]
    ) -> Callable[..., AsyncIterator[Any]]:
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                await _refuse_undecodable(request, context)
                async for item in behavior(request, context):
                    yield item
            except BaseException as err:
                await self._finish_failed(method, context, err, start)
                raise
            self._metrics.observe(method, context.code() or grpc.StatusCode.OK, time.perf_counter() - start)

        return observed

    def _wrap_writer(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Awaitable[None]]:
        """A streaming handler that writes its responses (context.write) instead of yielding them."""

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> None:
            start = time.perf_counter()
            try:
                await _refuse_undecodable(request, context)
                outcome = behavior(request, context)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
                if outcome is not None:  # a plain or async iterator after all: send what it gives
                    if hasattr(outcome, "__aiter__"):
                        async for item in outcome:
                            await context.write(item)
                    else:
                        for item in outcome:
                            await context.write(item)
            except BaseException as err:
                await self._finish_failed(method, context, err, start)
                raise
            self._metrics.observe(method, context.code() or grpc.StatusCode.OK, time.perf_counter() - start)

        return observed

    async def _finish_failed(
        self, method: str, context: grpc.aio.ServicerContext, err: BaseException, start: float
    ) -> None:
        elapsed = time.perf_counter() - start
        if isinstance(err, grpc.aio.AbortError):  # the handler chose its status
            code = context.code() or grpc.StatusCode.UNKNOWN
            details = clip(context.details() or "", LOGGED_DETAILS)
            log.info("rpc failed", extra={"method": method, "code": code.name, "details": details})
        elif isinstance(err, Exception):  # a bug: say so with a traceback, answer INTERNAL
            code = grpc.StatusCode.INTERNAL
            log.exception("rpc raised", extra={"method": method})
            self._metrics.observe(method, code, elapsed)
            message = clip(f"internal error in {method}: {type(err).__name__}: {err}", MAX_MESSAGE)
            await context.abort(code, message)  # raises
        else:  # cancelled by the client or by shutdown
            code = grpc.StatusCode.CANCELLED
        self._metrics.observe(method, code, elapsed)


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        message = clip(f"request does not parse: {request.error}", MAX_MESSAGE)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

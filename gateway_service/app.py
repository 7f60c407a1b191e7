"""The gateway's HTTP routes: POST /v1/chat/completions and /v1/completions, GET /v1/models, /health and
/metrics. /health and /metrics are open, as the servers' gRPC health is (probes carry no credentials, and neither
reveals anything a caller sent); the /v1 routes need the bearer token when one is set.

The two generation routes are plain ASGI handlers that the app calls before starlette: a burst of requests (64
streams started together) is handed to the executors one after another by the gateway's one thread, so each
request's own CPU delays the ones behind it, and starlette's middleware, router and Request object were a good
part of it. Everything else (other methods on those paths, their 405, the other routes) goes through starlette."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway_service.body import read_json_object
from gateway_service.caller_auth import CallerAuth
from gateway_service.choices import Choices, choice_requests
from gateway_service.errors import ApiError, from_rpc_error
from gateway_service.generation import Disconnected, Generation, watch_disconnect
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import ParsedRequest, model_error, parse_chat, parse_completion
from gateway_service.responses import Shaper
from gateway_service.upstream import Upstream
from specdec.v1 import common_pb2, executor_pb2

log = logging.getLogger("specdec.gateway")
CLIENT_CLOSED = 499  # nginx's status for a caller that went away; never seen by the caller
GENERATE_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# What starlette's Response writes for EventStream's headers (its media type gets starlette's charset).
EVENT_STREAM_HEADERS = (
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
)


@dataclass
class GatewayConfig:
    model_name: str
    max_body_bytes: int
    auth: CallerAuth
    make_upstream: Callable[[], Upstream]  # called inside the server's event loop (grpc.aio needs it)


class Gateway:
    def __init__(self, config: GatewayConfig, multiprocess_dir: str | None = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics(multiprocess_dir)
        self.upstream: Upstream | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.upstream = self.config.make_upstream()
        try:
            yield
        finally:
            await self.upstream.close()

    def app(self) -> ASGIApp:
        generate = {path: _GenerateRoute(self, route) for path, route in GENERATE_ROUTES.items()}
        routes = [
            *(Route(path, handler, methods=["POST"]) for path, handler in generate.items()),  # their 405s
            Route("/v1/models", self._route("models", self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._route("model", self.model), methods=["GET"]),
            Route("/health", self._route("health", self.health), methods=["GET"]),
            Route("/metrics", self._route("metrics", self.metrics_page), methods=["GET"]),
        ]
        starlette = Starlette(routes=routes, lifespan=self.lifespan)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
                handler = generate.get(scope["path"])
                if handler is not None:
                    await handler(scope, receive, send)
                    return
            await starlette(scope, receive, send)

        return app  # type: ignore[return-value]

    def _route(self, name: str, handler: Callable[[Request, str], Any]) -> Callable[[Request], Any]:
        """The handler with errors answered in OpenAI's shape and every answer counted."""

        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            response = await self._answer(name, handler(request, name))
            self.metrics.answered(name, response.status_code, time.perf_counter() - started)
            return response

        return endpoint

    async def _answer(self, name: str, answering: Any) -> Any:
        """What `answering` (a handler's coroutine) returns, or the response for the error it raised."""
        try:
            return await answering
        except ApiError as err:
            return err.response()
        except Disconnected:
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("unexpected error", extra={"route": name})
            return ApiError(500, "internal error in the gateway", code="internal_error").response()

    async def generate(self, scope: Scope, receive: Receive, route: str) -> Response | EventStream:
        headers = scope["headers"]
        token = self.config.auth.token(headers)
        data = await read_json_object(headers, receive, self.config.max_body_bytes)
        parsed: ParsedRequest = parse_chat(data) if route == "chat" else parse_completion(data)
        if (wrong_model := model_error(parsed.model, self.config.model_name)) is not None:
            raise wrong_model
        assert self.upstream is not None
        shaper, started = Shaper(parsed, self.config.model_name), time.perf_counter()
        generation: Generation | Choices
        if parsed.num_choices == 1:
            call = self.upstream.generate(parsed.generate, token)  # sent as soon as this task yields
            generation = Generation(call, parsed, shaper, self.metrics, route, started)
        else:
            calls = [self.upstream.generate(r, token) for r in choice_requests(parsed)]
            generation = Choices([Generation(c, parsed, shaper, self.metrics, route, started) for c in calls], shaper)
        watcher = watch_disconnect(receive, generation)
        self.metrics.open.inc()
        streaming = False
        try:
            first = await generation.first()
            if parsed.stream:
                streaming = True  # the stream leaves the gauge, and stops the watcher, when it ends
                return EventStream(generation, first, watcher, self.metrics)
            return JSONResponse(await generation.whole(first))
        except BaseException:
            generation.cancel()
            raise
        finally:
            if not streaming:
                watcher.cancel()
                self.metrics.open.dec()

    async def models(self, request: Request, route: str) -> Response:
        """The model the executors serve, from GetServerInfo; no model loaded: an empty list."""
        served = await self._served_model(request)
        return JSONResponse({"object": "list", "data": [] if served is None else [served]})

    async def model(self, request: Request, route: str) -> Response:
        """GET /v1/models/{model} (the SDKs' models.retrieve): the served model, or 404 model_not_found."""
        requested = request.path_params["model"]
        served = await self._served_model(request)
        wrong = model_error(requested, self.config.model_name)
        if wrong is not None:
            raise wrong
        if served is None:
            raise ApiError(404, "no model is loaded on the executors yet", "model", "model_not_found")
        return JSONResponse(served)

    async def _served_model(self, request: Request) -> dict[str, Any] | None:
        """The served model's object, from GetServerInfo (None: no model loaded)."""
        token = self.config.auth.token(request.scope["headers"])
        assert self.upstream is not None
        try:
            info = await self.upstream.server_info(token)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, lambda _: None) from None
        if not info.model_loaded:
            return None
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": info.started_unix_ms // 1000,
            "owned_by": "specdec",
            "max_model_len": info.info.max_model_len,
            "specdec": _model_details(info),
        }

    async def health(self, request: Request, route: str) -> Response:
        assert self.upstream is not None
        serving, status = await self.upstream.serving()
        body = {"status": "ok" if serving else "unavailable", "executor": status}
        return JSONResponse(body, status_code=200 if serving else 503)

    async def metrics_page(self, request: Request, route: str) -> Response:
        return self.metrics.response()


class _GenerateRoute:
    """POST /v1/chat/completions or /v1/completions as a plain ASGI app: `Gateway.generate` with its errors
    answered in OpenAI's shape and its answer counted, as `Gateway._route` does for starlette's routes."""

    def __init__(self, gateway: Gateway, route: str) -> None:
        self.gateway, self.route = gateway, route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway, started = self.gateway, time.perf_counter()
        response = await gateway._answer(self.route, gateway.generate(scope, receive, self.route))
        gateway.metrics.answered(self.route, response.status_code, time.perf_counter() - started)
        await response(scope, receive, send)


class EventStream:
    """A server-sent event stream, each event sent as it comes (starlette's StreamingResponse, minus its task
    group per request and its disconnect listener: `watcher` already cancels the generation when the caller goes
    away, which ends the stream). Leaves the open-generations gauge when it ends however it ends."""

    status_code = 200

    def __init__(
        self,
        generation: Generation | Choices,
        first: Any,  # the first message (of each choice: a list)
        watcher: asyncio.Task[None],
        metrics: GatewayMetrics,
    ) -> None:
        self.generation, self.first, self.watcher, self.metrics = generation, first, watcher, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM_HEADERS})
            await self.generation.stream(self.first, send)
        finally:
            self.generation.cancel()  # nothing once it has ended; a send that raised leaves no request running
            self.watcher.cancel()
            self.metrics.open.dec()


def _model_details(info: executor_pb2.GetServerInfoResponse) -> dict[str, Any]:
    model = info.info
    return {
        "architecture": model.architecture,
        "vocab_size": model.vocab_size,
        "spec_method": common_pb2.SpecMethod.Name(model.spec_method),
        "num_speculative_tokens": model.num_speculative_tokens,
        "target_backend": info.target_backend.backend,
        "draft_backend": info.draft_backend.backend,
        "device": info.capabilities.device_name,
        "server_version": info.server_version,
    }

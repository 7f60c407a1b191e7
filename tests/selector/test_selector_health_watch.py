"""grpc.health.v1 Health/Watch on a real selector server: the current status at once, NOT_SERVING at shutdown
and then the end of the stream; streaming handlers that write with context.write (as grpc_health's own Watch
does) pass the observing interceptor. Both used to fail with INTERNAL (a TypeError in observability.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from selector_service.main import start_selector
from specdec_runtime.auth import bearer_metadata
from specdec_runtime.grpc_runtime import ServerSettings, create_server, start_server
from specdec_runtime.health_status import HealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
WAIT_S = 10.0  # only so that a broken stream cannot hang the test


async def next_status(call: grpc.aio.UnaryStreamCall) -> int | None:
    """The next status a Watch stream sends; None when the stream has ended."""
    message = await asyncio.wait_for(call.read(), WAIT_S)
    return None if message is grpc.aio.EOF else message.status


@pytest.mark.parametrize("auth_token", [None, "watch-token"])
async def test_watch_streams_serving_then_not_serving_at_shutdown(auth_token: str | None) -> None:
    """Health needs no token even when the server wants one."""
    running = await start_selector(ServerSettings(port=0, auth_token=auth_token))
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            calls = {
                service: health.Watch(health_pb2.HealthCheckRequest(service=service))
                for service in ("", "specdec.v1.BackendSelector", "no.such.Service")
            }
            assert [await next_status(call) for call in calls.values()] == [SERVING, SERVING, SERVICE_UNKNOWN]
            await running.stop(5.0)
            stopped = True
            for service in ("", "specdec.v1.BackendSelector"):
                assert await next_status(calls[service]) == NOT_SERVING, service
            for service, call in calls.items():
                assert await next_status(call) is None, service  # the stream ends ...
                assert await call.code() is grpc.StatusCode.OK, service  # ... cleanly
    finally:
        if not stopped:
            await running.stop(0)


async def test_watch_follows_every_change_and_cancelling_leaves_nothing_behind() -> None:
    server, metrics = create_server(ServerSettings(), "test")
    running = await start_server(server, metrics, ServerSettings(port=0), ["test.Service"], ready=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service="test.Service"))
            assert await next_status(watch) == NOT_SERVING
            for serving in (True, False, True):
                await running.set_serving(serving)
                assert await next_status(watch) == (SERVING if serving else NOT_SERVING)
            check = await health.Check(health_pb2.HealthCheckRequest(service="test.Service"), timeout=WAIT_S)
            assert check.status == SERVING
            watch.cancel()
            many = [health.Watch(health_pb2.HealthCheckRequest(service=f"x{i}" * 100)) for i in range(20)]
            assert {await next_status(call) for call in many} == {SERVICE_UNKNOWN}
            for call in many:
                call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=WAIT_S)
            assert err.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        await running.stop(0)


async def test_streaming_handlers_that_write_pass_the_interceptor() -> None:
    """A unary-stream handler that writes with context.write and returns None (grpc_health's Watch, many
    hand-written servicers) is served, metered and logged like one that yields."""

    async def countdown(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for i in range(int(request.decode()), 0, -1):
            await context.write(str(i).encode())

    handler = grpc.method_handlers_generic_handler(
        "test.Writer", {"Countdown": grpc.unary_stream_rpc_method_handler(countdown)}
    )
    server, metrics = create_server(ServerSettings(), "test")
    server.add_generic_rpc_handlers((handler,))
    running = await start_server(server, metrics, ServerSettings(port=0), ["test.Writer"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = channel.unary_stream("/test.Writer/Countdown")(b"3", metadata=bearer_metadata("unused"))
            assert [message async for message in call] == [b"3", b"2", b"1"]
            assert await call.code() is grpc.StatusCode.OK
        ok = {"service": "test", "method": "Countdown", "code": "OK"}
        assert metrics.registry.get_sample_value("specdec_rpc_requests_total", ok) == 1.0
    finally:
        await running.stop(0)


async def test_a_shutdown_while_a_status_is_being_sent_still_sends_not_serving() -> None:
    """The Watch generator is suspended in its `yield` until gRPC has sent the message; a shutdown that
    lands then must still reach the watcher (it ended the stream without NOT_SERVING once in a CI run)."""
    servicer = HealthServicer()
    await servicer.set("svc", SERVING)
    stream = servicer.Watch(health_pb2.HealthCheckRequest(service="svc"), context=None)  # type: ignore[arg-type]
    assert (await anext(stream)).status == SERVING  # suspended in the yield: the send has not completed
    await servicer.enter_graceful_shutdown()
    assert (await anext(stream)).status == NOT_SERVING
    with pytest.raises(StopAsyncIteration):
        await anext(stream)

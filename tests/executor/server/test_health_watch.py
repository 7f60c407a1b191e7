"""grpc.health.v1 Health/Watch on a real executor server: NOT_SERVING until a model is loaded, SERVING once
LoadModel has warmed it up, NOT_SERVING at shutdown, then the stream ends. It used to fail with INTERNAL
(a TypeError in observability.py)."""

from __future__ import annotations

import asyncio

import grpc
import torch
from executor_builders import load_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.session import EngineSettings
from specdec.v1 import executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "specdec.v1.Executor")
WAIT_S = 30.0  # only so that a broken stream cannot hang the test


async def next_status(call: grpc.aio.UnaryStreamCall) -> int | None:
    message = await asyncio.wait_for(call.read(), WAIT_S)
    return None if message is grpc.aio.EOF else message.status


async def test_watch_follows_load_and_shutdown() -> None:
    executor = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8))
    )
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(service=service)) for service in SERVICES]
            assert [await next_status(watch) for watch in watches] == [NOT_SERVING, NOT_SERVING]

            await executor_pb2_grpc.ExecutorStub(channel).LoadModel(load_request(), timeout=WAIT_S)
            assert [await next_status(watch) for watch in watches] == [SERVING, SERVING]

            await executor.stop(1.0)
            stopped = True
            assert [await next_status(watch) for watch in watches] == [NOT_SERVING, NOT_SERVING]
            assert [await next_status(watch) for watch in watches] == [None, None]  # the streams end
            assert [await watch.code() for watch in watches] == [grpc.StatusCode.OK] * 2
    finally:
        if not stopped:
            await executor.stop(0)

"""The executor's selector link after an outage: while the selector is down, LoadModel fails with UNAVAILABLE
naming it and the loaded model keeps serving; the first LoadModel after the selector is back succeeds. Before,
the channel waited out gRPC's reconnect backoff (1 s, growing to 120 s) and failed every LoadModel meanwhile
(up to 9 s observed)."""

from __future__ import annotations

import grpc
import torch
from executor_builders import load_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.session import EngineSettings
from selector_service.main import start_selector
from specdec.v1 import executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

TIMEOUT_S = 60.0  # only so that a stuck call cannot hang the test


async def test_load_model_works_as_soon_as_the_selector_is_back() -> None:
    selector = await start_selector(ServerSettings(port=0))
    port = selector.port
    address = f"127.0.0.1:{port}"
    executor = await start_executor(
        ServerSettings(port=0),
        ExecutorOptions(device=torch.device("cpu"), selector_address=address, engine=EngineSettings(64, 8)),
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            await stub.LoadModel(load_request(), timeout=TIMEOUT_S)

            await selector.stop(0)
            for _ in range(3):  # each failure lengthens gRPC's default backoff
                try:
                    await stub.LoadModel(load_request(seed=1), timeout=TIMEOUT_S)
                except grpc.aio.AioRpcError as err:
                    assert err.code() is grpc.StatusCode.UNAVAILABLE, err.details()
                    assert err.details().startswith(f"the selector at {address} is unavailable"), err.details()
                else:
                    raise AssertionError("LoadModel succeeded without a selector")
            health = health_pb2_grpc.HealthStub(channel)
            serving = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert serving.status == health_pb2.HealthCheckResponse.SERVING  # the loaded model stays

            selector = await start_selector(ServerSettings(port=port))  # back, on the same port
            loaded = await stub.LoadModel(load_request(seed=2), timeout=TIMEOUT_S)  # the very first call
            assert loaded.target_backend.backend == "CPU_ATTN"
    finally:
        await executor.stop(0.5)
        await selector.stop(0)

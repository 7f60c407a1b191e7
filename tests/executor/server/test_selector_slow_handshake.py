"""A selector slow to finish the HTTP/2 handshake (a loaded host) still serves the executor's LoadModel: gRPC
gives each connection attempt its "minimum reconnect backoff" to finish, and at 100 ms a fresh clone's CI, on a
loaded 2-core machine, failed LoadModel with "connection attempt timed out before receiving SETTINGS frame". Here
the selector sits behind a proxy that holds its first bytes back for half a second."""

from __future__ import annotations

import asyncio

import grpc
import torch
from executor_builders import load_request

from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.session import EngineSettings
from selector_service.main import start_selector
from specdec.v1 import executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

HANDSHAKE_DELAY_S = 0.5
TIMEOUT_S = 60.0  # only so that a stuck call cannot hang the test


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float = 0.0) -> None:
    """Copy reader to writer; the first bytes `delay` seconds late."""
    try:
        first = True
        while data := await reader.read(65536):
            if first and delay:
                await asyncio.sleep(delay)
            first = False
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def slow_proxy(upstream_port: int) -> asyncio.Server:
    """A TCP proxy to 127.0.0.1:upstream_port whose answers start HANDSHAKE_DELAY_S late on every connection."""

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(
            pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer, HANDSHAKE_DELAY_S)
        )

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_load_model_waits_out_a_slow_selector_handshake() -> None:
    selector = await start_selector(ServerSettings(port=0))
    proxy = await slow_proxy(selector.port)
    proxy_port = proxy.sockets[0].getsockname()[1]
    executor = await start_executor(
        ServerSettings(port=0),
        ExecutorOptions(
            device=torch.device("cpu"), selector_address=f"127.0.0.1:{proxy_port}", engine=EngineSettings(64, 8)
        ),
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            loaded = await stub.LoadModel(load_request(), timeout=TIMEOUT_S)
            assert loaded.target_backend.backend == "CPU_ATTN"
    finally:
        await executor.stop(0.5)
        proxy.close()
        await selector.stop(0)

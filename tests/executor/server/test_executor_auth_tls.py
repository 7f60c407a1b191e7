"""The executor behind a shared token, TLS and mTLS, in-process on a free port with a tiny synthetic model:
refusals (UNAUTHENTICATED for unary calls and the streaming Generate, counted in the RPC metrics), acceptance,
health open without a token, and the blocking client of specdec_runtime.client over mTLS with a token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
import torch
from certs import TlsFiles, make_tls_files
from executor_builders import load_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_service.server.main import ExecutorOptions, RunningExecutor, start_executor
from executor_service.server.session import EngineSettings
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_runtime.auth import bearer_metadata
from specdec_runtime.client import open_channel
from specdec_runtime.grpc_runtime import ServerSettings

TOKEN = "executor-token-0123456789abcdef"
GOOD, WRONG = bearer_metadata(TOKEN), bearer_metadata("executor-token-0123456789abcdeX")
NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def tls(tmp_path) -> TlsFiles:  # type: ignore[no-untyped-def]
    return make_tls_files(tmp_path)


@asynccontextmanager
async def executor(**settings: object) -> AsyncIterator[RunningExecutor]:
    running = await start_executor(
        ServerSettings(port=0, **settings),  # type: ignore[arg-type]
        ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8)),
    )
    try:
        yield running
    finally:
        await running.stop(0.5)


def generate_request(request_id: str, max_tokens: int = 4) -> executor_pb2.GenerateRequest:
    return executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=[3, 1, 4, 1, 5]),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def health(channel: grpc.aio.Channel) -> int:
    """Health without any metadata, as a container probe asks."""
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status


async def refused(call) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value
    assert TOKEN not in err.value.details()
    return err.value.details()


async def drain(stream) -> list[executor_pb2.GenerateResponse]:  # type: ignore[no-untyped-def]
    return [response async for response in stream]


async def unauthenticated_count(running: RunningExecutor, method: str, expected: float) -> float | None:
    """The refusals counted for `method`; a stream's handler is counted just after the client has its status."""
    labels = {"service": "executor", "method": method, "code": "UNAUTHENTICATED"}
    for _ in range(40):
        count = running.server.metrics.registry.get_sample_value("specdec_rpc_requests_total", labels)
        if count == expected:
            break
        await asyncio.sleep(0.05)
    return count


async def test_token_guards_unary_and_streaming_calls() -> None:
    async with (
        executor(auth_token=TOKEN) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.server.port}") as channel,
    ):
        stub = executor_pb2_grpc.ExecutorStub(channel)
        assert await health(channel) == NOT_SERVING
        assert "missing 'authorization' metadata" in await refused(
            stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest())
        )
        assert await refused(stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), metadata=WRONG)) == (
            "invalid bearer token"
        )
        await refused(stub.LoadModel(load_request()))
        assert await health(channel) == NOT_SERVING and running.servicer.session is None
        capabilities = await stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), metadata=GOOD)
        assert capabilities.platform == common_pb2.PLATFORM_CPU
        loaded = await stub.LoadModel(load_request(), metadata=GOOD)
        assert loaded.target_backend.backend == "CPU_ATTN"
        assert await health(channel) == SERVING

        await refused(drain(stub.Generate(generate_request("no-token"))))
        assert await refused(drain(stub.Generate(generate_request("wrong"), metadata=WRONG))) == "invalid bearer token"
        await refused(stub.Abort(executor_pb2.AbortRequest(request_ids=["x"])))
        responses = await drain(stub.Generate(generate_request("ok"), metadata=GOOD))
        assert responses[-1].finished.completion_tokens == 4 and responses[-1].finished.finish_reason == "length"
        assert sum(len(r.token_ids) for r in responses) == 4
        assert running.servicer.session.engine.num_live == 0

        assert await unauthenticated_count(running, "Generate", 2.0) == 2.0
        assert await unauthenticated_count(running, "GetCapabilities", 2.0) == 2.0
        assert await unauthenticated_count(running, "LoadModel", 1.0) == 1.0


async def test_tls_needs_the_ca_and_refuses_plaintext(tls: TlsFiles) -> None:
    async with executor(tls_cert=str(tls.server_cert), tls_key=str(tls.server_key)) as running:
        address = f"localhost:{running.server.port}"
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls.ca.read_bytes())) as channel:
            reply = await executor_pb2_grpc.ExecutorStub(channel).GetCapabilities(executor_pb2.GetCapabilitiesRequest())
            assert reply.platform == common_pb2.PLATFORM_CPU
            assert await health(channel) == NOT_SERVING
        async with grpc.aio.insecure_channel(address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await executor_pb2_grpc.ExecutorStub(plain).GetCapabilities(
                    executor_pb2.GetCapabilitiesRequest(), timeout=5
                )
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_mtls_with_a_token(tls: TlsFiles) -> None:
    """mTLS and a token together: no client certificate fails the handshake; a certificate without the token is
    UNAUTHENTICATED; both load and generate, through grpc.aio and through the blocking open_channel."""
    settings = dict(tls_cert=str(tls.server_cert), tls_key=str(tls.server_key), tls_client_ca=str(tls.ca))
    ca = tls.ca.read_bytes()
    client_pair = {"private_key": tls.client_key.read_bytes(), "certificate_chain": tls.client_cert.read_bytes()}
    async with executor(**settings, auth_token=TOKEN) as running:
        address = f"localhost:{running.server.port}"
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as no_cert:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await executor_pb2_grpc.ExecutorStub(no_cert).GetCapabilities(
                    executor_pb2.GetCapabilitiesRequest(), metadata=GOOD, timeout=5
                )
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca, **client_pair)) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            await refused(stub.LoadModel(load_request()))
            assert await health(channel) == NOT_SERVING
            await stub.LoadModel(load_request(), metadata=GOOD)
            assert await health(channel) == SERVING
            await refused(drain(stub.Generate(generate_request("mtls-no-token"))))
            responses = await drain(stub.Generate(generate_request("mtls", 3), metadata=GOOD))
            assert responses[-1].finished.completion_tokens == 3

        def blocking(token: str | None) -> tuple[int, int]:
            """GetCapabilities and a whole Generate stream through open_channel's token interceptor."""
            files = (str(tls.ca), str(tls.client_cert), str(tls.client_key))
            with open_channel(address, *files, auth_token=token) as blocking_channel:
                stub = executor_pb2_grpc.ExecutorStub(blocking_channel)
                platform = stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), timeout=10).platform
                stream = list(stub.Generate(generate_request(f"blocking-{token}", 2), timeout=30))
                return platform, stream[-1].finished.completion_tokens

        assert await asyncio.to_thread(blocking, TOKEN) == (common_pb2.PLATFORM_CPU, 2)
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.to_thread(blocking, None)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]

"""The selector's gRPC layer end to end: a real server on a free port, real clients."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from builders import cuda, dflash, layers, request
from certs import make_tls_files
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from selection.selector import select_backends
from selector_service.main import start_selector
from specdec.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from specdec_runtime.grpc_runtime import RunningServer, ServerSettings, create_server, start_server

SERVICE = "specdec.v1.BackendSelector"


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_selector(ServerSettings(port=0, metrics_port=0))
    yield running
    await running.stop(0)


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def details_of(err: grpc.aio.AioRpcError) -> list:
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    return list(status.details)


async def test_health_is_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_select_over_grpc_equals_in_process(channel: grpc.aio.Channel) -> None:
    req = request(cuda(9, 0, flash_attn="4.0.0b36"), speculative=dflash())
    reply = await selector_pb2_grpc.BackendSelectorStub(channel).SelectBackends(req)
    assert reply == select_backends(req)
    assert reply.drafter.use_non_causal


async def test_bad_input_then_keeps_serving(channel: grpc.aio.Channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    bad = request(target=layers(head_size=0))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(bad)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    assert details_of(err.value)[0].Unpack(bad_request)
    assert [v.field for v in bad_request.field_violations] == ["target_layers.head_size"]
    # An empty request, garbage bytes: still answered, and the server stays up.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(selector_pb2.SelectBackendsRequest())
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    raw = channel.unary_unary(f"/{SERVICE}/SelectBackends")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(b"\xff\xff\xff\xff")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    assert (await stub.SelectBackends(request())).target.backend == "FLASH_ATTN"


async def test_explicit_invalid_backend_message(channel: grpc.aio.Channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(request(cuda(9, 0), backend="FLEX_ATTENTION", target=layers(has_sink=True)))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "Selected backend FLEX_ATTENTION is not valid for this configuration. Reason: ['attention sinks not supported']"
    )


async def test_no_valid_backend_is_failed_precondition(channel: grpc.aio.Channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(request(cuda(9, 0), layers(use_mla=True)))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("No valid attention backend found for cuda")
    failure = error_details_pb2.PreconditionFailure()
    assert details_of(err.value)[0].Unpack(failure)
    assert [v.subject for v in failure.violations] == ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]


async def test_list_backends(channel: grpc.aio.Channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    everything = await stub.ListBackends(selector_pb2.ListBackendsRequest())
    assert len(everything.backends) == 8 and len(everything.priorities) == 4
    assert "non-causal attention not supported" in everything.reason_vocabulary
    cpu_only = await stub.ListBackends(selector_pb2.ListBackendsRequest(platform=common_pb2.PLATFORM_CPU))
    assert [b.name for b in cpu_only.backends] == ["TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListBackends(selector_pb2.ListBackendsRequest(platform=17))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_reflection_lists_the_services(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in responses:
        names = {s.name for s in response.list_services_response.service}
        break
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_metrics_count_requests_by_code(server: RunningServer, channel: grpc.aio.Channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    await stub.SelectBackends(request())
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.SelectBackends(request(target=layers(head_size=-1)))
    expected = [
        'specdec_rpc_requests_total{code="OK",method="SelectBackends",service="selector"} 1.0',
        'specdec_rpc_errors_total{code="INVALID_ARGUMENT",method="SelectBackends",service="selector"} 1.0',
        'specdec_rpc_latency_seconds_count{method="SelectBackends",service="selector"} 2.0',
    ]
    # The server counts an RPC once its handler has returned, which may be just after the caller has the status
    # (a loaded machine showed the error's count missing): scrape until the counts are there, a while at most.
    for _ in range(100):
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        if all(line in text for line in expected):
            break
        await asyncio.sleep(0.05)
    assert [line for line in expected if line not in text] == []


async def test_oversized_request_is_refused() -> None:
    running = await start_selector(ServerSettings(port=0, max_message_bytes=1024))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = selector_pb2_grpc.BackendSelectorStub(ch)
            huge = request()
            huge.hardware.device_name = "x" * 4096
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SelectBackends(huge)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await stub.SelectBackends(request())).target.backend == "FLASH_ATTN"
    finally:
        await running.stop(0)


async def test_unexpected_exception_becomes_internal() -> None:
    """A bug in a handler answers INTERNAL with the error, and the server keeps serving."""

    class Broken(selector_pb2_grpc.BackendSelectorServicer):
        async def SelectBackends(self, req, context):
            raise RuntimeError("boom")

    server, metrics = create_server(ServerSettings(), "test")
    selector_pb2_grpc.add_BackendSelectorServicer_to_server(Broken(), server)
    running = await start_server(server, metrics, ServerSettings(port=0), [SERVICE])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = selector_pb2_grpc.BackendSelectorStub(ch)
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SelectBackends(request())
                assert err.value.code() is grpc.StatusCode.INTERNAL
                assert "RuntimeError: boom" in err.value.details()
    finally:
        await running.stop(0)


async def test_tls_and_mtls(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    plain_tls = await start_selector(ServerSettings(port=0, tls_cert=str(tls.server_cert), tls_key=str(tls.server_key)))
    mutual = await start_selector(
        ServerSettings(port=0, tls_cert=str(tls.server_cert), tls_key=str(tls.server_key), tls_client_ca=str(tls.ca))
    )
    ca = tls.ca.read_bytes()
    client_pair = {"private_key": tls.client_key.read_bytes(), "certificate_chain": tls.client_cert.read_bytes()}
    try:

        async def select(port: int, credentials: grpc.ChannelCredentials | None) -> str:
            address = f"localhost:{port}"
            ch = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
            async with ch:
                stub = selector_pb2_grpc.BackendSelectorStub(ch)
                return (await stub.SelectBackends(request(), timeout=5)).target.backend

        assert await select(plain_tls.port, grpc.ssl_channel_credentials(ca)) == "FLASH_ATTN"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # plaintext against TLS
            await select(plain_tls.port, None)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert await select(mutual.port, grpc.ssl_channel_credentials(ca, **client_pair)) == "FLASH_ATTN"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no client certificate
            await select(mutual.port, grpc.ssl_channel_credentials(ca))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await plain_tls.stop(0)
        await mutual.stop(0)


def test_sigterm_drains_and_exits_cleanly(tmp_path: Path) -> None:
    """The real command: serves, answers, goes NOT_SERVING on SIGTERM, finishes, exits 0."""
    port_file = tmp_path / "port"
    env = {**os.environ, "SPECDEC_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "selector_service.main",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--grace-seconds",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120  # a no-hang bound, not a performance bar
        while not port_file.exists() or not port_file.read_text().strip():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "selector did not start"
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text().strip()}") as ch:
            stub = selector_pb2_grpc.BackendSelectorStub(ch)
            assert stub.SelectBackends(request(), timeout=5).target.backend == "FLASH_ATTN"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = proc.stderr.read()
    assert '"msg": "serving"' in logs and '"msg": "shutting down"' in logs and '"msg": "stopped"' in logs


def test_env_vars_configure_the_server(tmp_path: Path) -> None:
    """Flags and SPECDEC_* variables are interchangeable."""
    from specdec_runtime.grpc_runtime import EnvDefaultsParser, add_server_arguments

    os.environ["SPECDEC_METRICS_PORT"] = "9555"
    try:
        parser = EnvDefaultsParser()
        add_server_arguments(parser, default_port=1)
        assert parser.parse_args([]).metrics_port == 9555
        assert parser.parse_args(["--metrics-port", "7"]).metrics_port == 7
    finally:
        del os.environ["SPECDEC_METRICS_PORT"]


def test_bad_env_values_are_refused_like_bad_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A SPECDEC_* value its flag's choices or type refuse exits 2 naming the variable, unless the flag overrides it."""
    from specdec_runtime.grpc_runtime import EnvDefaultsParser, add_server_arguments

    monkeypatch.setenv("SPECDEC_LOG_LEVEL", "verbose")
    monkeypatch.setenv("SPECDEC_METRICS_PORT", "ninety")
    monkeypatch.setenv("SPECDEC_LOG_FORMAT", "text")
    parser = EnvDefaultsParser(prog="specdec-test")
    add_server_arguments(parser, default_port=1)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "SPECDEC_LOG_LEVEL='verbose' (for --log-level): invalid choice (choose from 'debug', 'info'" in err
    assert "SPECDEC_METRICS_PORT='ninety' (for --metrics-port): invalid int value" in err
    args = parser.parse_args(["--log-level", "debug", "--metrics-port", "9"])
    assert (args.log_level, args.metrics_port, args.log_format) == ("debug", 9, "text")
    shown = " ".join(parser.format_help().split())
    assert "[env SPECDEC_LOG_LEVEL]" in shown and "[env SPECDEC_LOG_FORMAT]" in shown

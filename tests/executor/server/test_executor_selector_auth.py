"""The executor's selector client behind a token, TLS and mTLS: an in-process selector and an in-process executor
(--selector-address) with a tiny synthetic model. LoadModel works with the right token / CA / client
certificate, and fails with FAILED_PRECONDITION (refused token) or UNAVAILABLE (TLS mismatch) naming the
selector, while the executor keeps serving; the flags, their environment variables and the default token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import torch
from certs import TlsFiles, make_tls_files
from executor_builders import load_request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_service.server.main import (
    ExecutorOptions,
    RunningExecutor,
    add_selector_client_arguments,
    selector_client_settings,
    start_executor,
)
from executor_service.server.selection import BackendChooser, SelectorClientSettings
from executor_service.server.session import EngineSettings
from selector_service.main import start_selector
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_runtime.client import open_aio_channel
from specdec_runtime.grpc_runtime import EnvDefaultsParser, RunningServer, ServerSettings, add_server_arguments

TOKEN = "deployment-token-0123456789abcdef"
OTHER = "rotated-token-fedcba9876543210"
SERVING = health_pb2.HealthCheckResponse.SERVING


@asynccontextmanager
async def selector(**settings: object) -> AsyncIterator[RunningServer]:
    running = await start_selector(ServerSettings(**{"port": 0, **settings}), cache_size=16)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        await running.stop(0)


class ExecutorClient:
    """Calls to the executor through open_aio_channel, which adds the executor's own token (when it has one) to
    unary and streaming calls alike."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel, self.stub = channel, executor_pb2_grpc.ExecutorStub(channel)

    async def load(self, request: executor_pb2.LoadModelRequest) -> executor_pb2.LoadModelResponse:
        return await self.stub.LoadModel(request, timeout=60)

    async def load_error(self, request: executor_pb2.LoadModelRequest) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await self.load(request)
        return err.value

    async def capabilities(self) -> int:
        request = executor_pb2.GetCapabilitiesRequest()
        return (await self.stub.GetCapabilities(request, timeout=10)).platform

    async def generate(self, max_tokens: int) -> int:
        request = executor_pb2.GenerateRequest(
            request_id=f"r{max_tokens}",
            token_ids=executor_pb2.TokenIds(ids=[3, 1, 4, 1, 5]),
            sampling=executor_pb2.SamplingParams(max_tokens=max_tokens),
        )
        responses = [r async for r in self.stub.Generate(request, timeout=60)]
        return responses[-1].finished.completion_tokens

    async def health(self) -> int:
        return (await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest())).status


@asynccontextmanager
async def executor(
    selector_address: str, client: SelectorClientSettings, auth_token: str | None = None
) -> AsyncIterator[ExecutorClient]:
    """An executor (its own token: `auth_token`) asking `selector_address` for backends, and a client to it."""
    running: RunningExecutor = await start_executor(
        ServerSettings(port=0, auth_token=auth_token),
        ExecutorOptions(
            torch.device("cpu"), selector_address=selector_address, selector_client=client, engine=EngineSettings(64, 8)
        ),
    )
    try:
        async with open_aio_channel(f"127.0.0.1:{running.server.port}", auth_token=auth_token) as channel:
            yield ExecutorClient(channel)
    finally:
        await running.stop(0.5)


def selector_calls(running: RunningServer, code: str) -> float:
    labels = {"service": "selector", "method": "SelectBackends", "code": code}
    return running.metrics.registry.get_sample_value("specdec_rpc_requests_total", labels) or 0.0


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    parser = EnvDefaultsParser()
    add_server_arguments(parser, default_port=1)
    add_selector_client_arguments(parser)
    return parser.parse_args(argv)


async def test_the_shared_token_reaches_the_selector_and_a_rotated_one_fails_clearly() -> None:
    """The compose setup: one SPECDEC_AUTH_TOKEN on both services; the executor sends its own token by default.
    Then the selector comes back with another token: LoadModel fails with FAILED_PRECONDITION naming the
    selector, and the loaded model keeps serving."""
    async with selector(auth_token=TOKEN) as sel:
        address, port = f"127.0.0.1:{sel.port}", sel.port
        client = selector_client_settings(parse(["--selector-address", address, "--auth-token", TOKEN]))
        assert client.auth_token == TOKEN and TOKEN not in repr(client)
        async with executor(address, client, auth_token=TOKEN) as ex:
            assert (await ex.load(load_request())).target_backend.backend == "CPU_ATTN"
            assert selector_calls(sel, "OK") == 1.0 and selector_calls(sel, "UNAUTHENTICATED") == 0.0
            assert await ex.generate(3) == 3
            await sel.stop(0)
            async with selector(auth_token=OTHER, port=port) as rotated:
                err = await ex.load_error(load_request())
                assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert err.details().startswith(f"the selector at {address} refused authentication (invalid bearer")
                assert "--selector-auth-token" in err.details() and TOKEN not in err.details()
                assert selector_calls(rotated, "UNAUTHENTICATED") == 1.0
                assert await ex.health() == SERVING  # the loaded model stays
                assert await ex.generate(4) == 4
                info = await ex.stub.GetModelInfo(executor_pb2.GetModelInfoRequest())
                assert info.target_backend.backend == "CPU_ATTN"


async def test_a_selector_token_of_its_own_and_a_missing_one() -> None:
    async with selector(auth_token=TOKEN) as sel:
        address = f"127.0.0.1:{sel.port}"
        async with executor(address, SelectorClientSettings()) as ex:  # no token at all
            err = await ex.load_error(load_request())
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"the selector at {address} refused authentication (missing 'authorization'" in err.details()
            assert await ex.capabilities() == common_pb2.PLATFORM_CPU  # still answering
            assert (await ex.load_error(load_request())).code() is grpc.StatusCode.FAILED_PRECONDITION  # not stuck
        # The executor's own token differs from the selector's: --selector-auth-token wins.
        own = selector_client_settings(
            parse(["--selector-address", address, "--auth-token", OTHER, "--selector-auth-token", TOKEN])
        )
        async with executor(address, own, auth_token=OTHER) as ex:
            assert (await ex.load(load_request())).target_backend.backend == "CPU_ATTN"
        assert selector_calls(sel, "OK") == 1.0 and selector_calls(sel, "UNAUTHENTICATED") == 2.0


async def test_mtls_selector_with_a_token(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    (tmp_path / "other").mkdir()
    stranger: TlsFiles = make_tls_files(tmp_path / "other")  # a CA that did not sign the selector's certificate
    served = dict(tls_cert=str(tls.server_cert), tls_key=str(tls.server_key), tls_client_ca=str(tls.ca))
    good = SelectorClientSettings(str(tls.ca), str(tls.client_cert), str(tls.client_key), auth_token=TOKEN)
    async with selector(**served, auth_token=TOKEN) as sel:
        address = f"localhost:{sel.port}"
        async with executor(address, good) as ex:
            assert (await ex.load(load_request())).target_backend.backend == "CPU_ATTN"
            assert await ex.health() == SERVING and await ex.generate(2) == 2
        mismatches = {
            "another CA": SelectorClientSettings(str(stranger.ca), str(tls.client_cert), str(tls.client_key)),
            "no client certificate": SelectorClientSettings(str(tls.ca), auth_token=TOKEN),
            "another server name": SelectorClientSettings(
                str(tls.ca), str(tls.client_cert), str(tls.client_key), "selector.invalid", TOKEN
            ),
            "plaintext": SelectorClientSettings(auth_token=TOKEN),
        }
        for why, client in mismatches.items():
            async with executor(address, client) as ex:
                err = await ex.load_error(load_request())
                assert err.code() is grpc.StatusCode.UNAVAILABLE, why
                assert err.details().startswith(f"the selector at {address} is unavailable: "), why
                assert await ex.capabilities() == common_pb2.PLATFORM_CPU, why
        assert selector_calls(sel, "OK") == 1.0


async def test_flags_environment_and_bad_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "selector_token"
    token_file.write_text(f"{TOKEN}\n")
    monkeypatch.setenv("SPECDEC_SELECTOR_ADDRESS", "selector:50051")
    monkeypatch.setenv("SPECDEC_SELECTOR_TLS_CA", "/certs/ca.crt")
    monkeypatch.setenv("SPECDEC_SELECTOR_TLS_SERVER_NAME", "selector.internal")
    monkeypatch.setenv("SPECDEC_SELECTOR_AUTH_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", OTHER)
    assert selector_client_settings(parse([])) == SelectorClientSettings(
        "/certs/ca.crt", None, None, "selector.internal", TOKEN
    )
    with pytest.raises(ValueError, match="give --selector-auth-token or --selector-auth-token-file, not both"):
        selector_client_settings(parse(["--selector-auth-token", TOKEN]))
    monkeypatch.delenv("SPECDEC_SELECTOR_ADDRESS")
    with pytest.raises(ValueError, match="need --selector-address"):
        selector_client_settings(parse([]))
    for name in ("SPECDEC_SELECTOR_TLS_CA", "SPECDEC_SELECTOR_TLS_SERVER_NAME", "SPECDEC_SELECTOR_AUTH_TOKEN_FILE"):
        monkeypatch.delenv(name)
    assert selector_client_settings(parse([])).auth_token == OTHER  # unused without an address, but harmless
    with pytest.raises(ValueError, match="printable ASCII"):
        selector_client_settings(parse(["--selector-address", "s:1", "--selector-auth-token", "two words"]))
    with pytest.raises(ValueError, match="--selector-tls-cert, --selector-tls-key and --selector-tls-server-name"):
        BackendChooser("s:1", SelectorClientSettings(tls_cert="client.crt", tls_key="client.key"))
    with pytest.raises(ValueError, match="both --selector-tls-cert and --selector-tls-key"):
        BackendChooser("s:1", SelectorClientSettings(tls_ca=str(token_file), tls_cert="client.crt"))
    with pytest.raises(FileNotFoundError):  # at start, not at the first LoadModel
        BackendChooser("s:1", SelectorClientSettings(tls_ca=str(tmp_path / "missing.crt")))

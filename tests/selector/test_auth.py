"""The shared-token check on the selector: refusals (UNAUTHENTICATED, counted, token never echoed), acceptance,
health open without a token, the server flags and environment, and the `specdec` CLI's --auth-token."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from builders import request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from selector_service.main import start_selector
from specdec.v1 import selector_pb2, selector_pb2_grpc
from specdec_cli.cli import main as cli_main
from specdec_runtime.auth import bearer_metadata, resolve_token
from specdec_runtime.grpc_runtime import EnvDefaultsParser, RunningServer, ServerSettings, add_server_arguments

TOKEN = "s3cret-Token_value.42"
SERVICE = "specdec.v1.BackendSelector"


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_selector(ServerSettings(port=0, auth_token=TOKEN))
    yield running
    await running.stop(0)


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


async def refusal(call) -> str:  # type: ignore[no-untyped-def]
    """Await `call`, expect UNAUTHENTICATED, return its message (which must not contain the token)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value
    assert TOKEN not in err.value.details()
    return err.value.details()


async def test_refused_without_or_with_a_wrong_token_then_served(server: RunningServer, channel) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(channel)
    missing = await refusal(stub.SelectBackends(request()))
    assert missing == "missing 'authorization' metadata: this server requires 'authorization: Bearer <token>'"
    assert await refusal(stub.SelectBackends(request(), metadata=bearer_metadata("wrong"))) == "invalid bearer token"
    assert await refusal(stub.SelectBackends(request(), metadata=bearer_metadata(TOKEN + "x"))) == (
        "invalid bearer token"
    )
    basic = await refusal(
        stub.ListBackends(selector_pb2.ListBackendsRequest(), metadata=(("authorization", f"Basic {TOKEN}"),))
    )
    assert basic == "the 'authorization' metadata must read 'Bearer <token>'"
    # Garbage bytes without a token: refused before parsing, not INVALID_ARGUMENT.
    raw = channel.unary_unary(f"/{SERVICE}/SelectBackends")
    await refusal(raw(b"\xff\xff\xff\xff"))
    # Still serving; the scheme is case-insensitive; a refused call left nothing behind.
    reply = await stub.SelectBackends(request(), metadata=bearer_metadata(TOKEN))
    assert reply.target.backend == "FLASH_ATTN"
    lower = await stub.SelectBackends(request(), metadata=(("authorization", f"bearer {TOKEN}"),))
    assert lower == reply
    codes = {
        code: server.metrics.registry.get_sample_value(
            "specdec_rpc_requests_total", {"service": "selector", "method": "SelectBackends", "code": code}
        )
        for code in ("UNAUTHENTICATED", "OK", "INVALID_ARGUMENT")
    }
    assert codes == {"UNAUTHENTICATED": 4.0, "OK": 2.0, "INVALID_ARGUMENT": None}


async def test_health_is_open_and_reflection_is_not(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]

    async def first_answer(metadata: tuple | None) -> reflection_pb2.ServerReflectionResponse:
        async for answer in reflection.ServerReflectionInfo(iter(ask), metadata=metadata):
            return answer
        raise AssertionError("no reflection answer")

    # A bidirectional stream is guarded too. Nothing is written on the refused stream: a write racing the
    # server's refusal fails on the client with INTERNAL ("execute_batch") instead of the call's status.
    refused = reflection.ServerReflectionInfo()
    assert await refused.code() is grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in await refused.details()
    answer = await first_answer(bearer_metadata(TOKEN))
    assert SERVICE in {s.name for s in answer.list_services_response.service}


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert resolve_token(None, None) is None
    assert resolve_token(TOKEN, None) == TOKEN
    assert resolve_token(None, str(token_file)) == TOKEN  # the trailing newline is not part of it
    with pytest.raises(ValueError, match="not both"):
        resolve_token(TOKEN, str(token_file))
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_token(None, str(token_file))
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        resolve_token("two words", None)
    with pytest.raises(FileNotFoundError):
        resolve_token(None, str(tmp_path / "missing"))
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN_FILE", "/run/secrets/specdec")
    parser = EnvDefaultsParser()
    add_server_arguments(parser, default_port=1)
    settings = ServerSettings.from_args(parser.parse_args([]))
    assert (settings.auth_token, settings.auth_token_file) == (TOKEN, "/run/secrets/specdec")
    assert TOKEN not in repr(settings)
    assert ServerSettings.from_args(parser.parse_args(["--auth-token", "other"])).auth_token == "other"


async def test_a_bad_token_setting_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        await start_selector(ServerSettings(port=0, auth_token=TOKEN, auth_token_file=str(tmp_path / "token")))


def test_cli_token_from_flag_and_env(
    tmp_path: Path,
    launch_server: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The real server command with SPECDEC_AUTH_TOKEN_FILE, and the CLI with --auth-token or SPECDEC_AUTH_TOKEN."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN_FILE", str(token_file))
    address = launch_server("selector").address  # type: ignore[attr-defined]
    monkeypatch.delenv("SPECDEC_AUTH_TOKEN_FILE")
    monkeypatch.delenv("SPECDEC_AUTH_TOKEN", raising=False)
    assert cli_main(["backends", "--selector", address]) == 2
    assert "error: UNAUTHENTICATED: missing 'authorization' metadata" in capsys.readouterr().err
    assert cli_main(["backends", "--selector", address, "--auth-token", "wrong"]) == 2
    assert "error: UNAUTHENTICATED: invalid bearer token" in capsys.readouterr().err
    assert cli_main(["backends", "--selector", address, "--platform", "cpu", "--auth-token", TOKEN]) == 0
    assert "CPU_ATTN" in capsys.readouterr().out
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", TOKEN)
    assert cli_main(["backends", "--selector", address, "--json"]) == 0
    assert '"name": "FLASH_ATTN"' in capsys.readouterr().out
    assert cli_main(["backends", "--selector", address, "--auth-token", "has space"]) == 1
    assert "printable ASCII without spaces" in capsys.readouterr().err

"""`specdec server-info` and `specdec loads` against an in-process CPU executor: text and
JSON answers equal the RPCs', an unreachable executor is a clean error."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from toy_model import write_toy_model

from executor_service.server.main import RunningExecutor
from specdec.v1 import common_pb2, executor_pb2
from specdec_cli.cli import EXIT_RPC_ERROR, main


async def specdec(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))  # a blocking client: off the server's event loop


async def test_server_info_and_loads(executor: RunningExecutor, stub, tmp_path, capsys) -> None:
    address = f"127.0.0.1:{executor.server.port}"
    assert await specdec("server-info", "--executor", address) == 0
    out = capsys.readouterr().out
    assert "model: none loaded" in out and "limits: 8 requests per step, 16 in flight" in out

    write_toy_model(tmp_path / "toy", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="toy"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=32
    )
    await stub.LoadModel(load)
    request = executor_pb2.GenerateRequest(request_id="r", sampling=executor_pb2.SamplingParams(max_tokens=4))
    request.messages.messages.add(role="user", content="Hi")
    [r async for r in stub.Generate(request)]

    assert await specdec("server-info", "--executor", address, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    info = await stub.GetServerInfo(executor_pb2.GetServerInfoRequest())
    assert (shown["serverVersion"], shown["modelLoaded"], shown["info"]["hasChatTemplate"]) == (
        info.server_version,
        True,
        True,
    )
    assert await specdec("server-info", "--executor", address) == 0
    assert "chat template: yes" in capsys.readouterr().out
    assert await specdec("loads", "--executor", address) == 0
    out = capsys.readouterr().out
    assert "requests: 0 running, 0 queued" in out and "0/32 blocks used" in out
    loads = await stub.GetLoads(executor_pb2.GetLoadsRequest())
    assert f"{loads.prompt_tokens_total} prompt and {loads.generation_tokens_total} generated in all" in out
    assert loads.generation_tokens_total == 4


@pytest.mark.parametrize("command", ["server-info", "loads"])
async def test_an_unreachable_executor_is_a_clean_error(command: str, capsys) -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    assert await specdec(command, "--executor", address, "--timeout", "2") == EXIT_RPC_ERROR
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err
    assert "Traceback" not in err

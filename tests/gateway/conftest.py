"""A gateway in front of a real executor, both subprocesses: the executor serves a tiny checkpoint with the toy
tokenizer and a chat template (tests/toy_model.py), a synthetic EAGLE-3 drafter, and requires TOKEN; the gateway
requires TOKEN too and sends it on. One stack per test module (starting an executor takes seconds)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gateway_stack import MODEL, TOKEN, start_executor
from server_processes import ServerProcess, spawn_server

pytest.importorskip("torch", reason="the executor needs torch")
pytest.importorskip("starlette", reason="the gateway needs the gateway extra: pip install -e '.[gateway]'")


def start_gateway(directory: Path, name: str, executor: str, *args: str) -> ServerProcess:
    return spawn_server("gateway", name, directory, "--executor", executor, "--served-model-name", MODEL, *args)


@dataclass
class Stack:
    executor: ServerProcess
    gateway: ServerProcess

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.address}/v1"

    def client(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", TOKEN), max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("stack")
    executor = start_executor(directory, "executor", "--auth-token", TOKEN)
    try:
        gateway = start_gateway(directory, "gateway", executor.address, "--auth-token", TOKEN)
    except BaseException:
        executor.stop()
        raise
    yield Stack(executor, gateway)
    statuses = {"gateway": gateway.stop(), "executor": executor.stop()}
    assert statuses == {"gateway": 0, "executor": 0}, f"{gateway.log()}\n{executor.log()}"


@pytest.fixture
def launch_gateway(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """`launch_gateway(executor_address, *args)`: a gateway of this test alone, stopped (exit 0) at teardown."""
    started: list[ServerProcess] = []

    def launch(executor: str, *args: str) -> ServerProcess:
        started.append(start_gateway(tmp_path, f"gateway-{len(started)}", executor, *args))
        return started[-1]

    yield launch
    failures = [gateway.log() for gateway in started if not gateway.stopped and gateway.stop() != 0]
    assert not failures, "\n\n".join(failures)

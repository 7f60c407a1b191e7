"""A CPU executor server started in-process for a test, and a stub on it (modules with other needs define their
own `executor` fixture, which takes precedence).

The executor's tests live in folders that mirror executor_service/ (server/, engine/, models/, runner/, sample/,
spec_decode/, tp/); the helper modules they share (builders, references, case tables) stay here, importable by
name from every folder below."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from executor_service.server.main import ExecutorOptions, RunningExecutor, start_executor
from executor_service.server.session import EngineSettings
from specdec.v1 import executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

HELPERS = str(Path(__file__).resolve().parent)
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[RunningExecutor]:
    running = await start_executor(
        ServerSettings(port=0, metrics_port=0),
        ExecutorOptions(
            device=torch.device("cpu"), model_root=tmp_path, engine=EngineSettings(64, 8), max_live_requests=16
        ),
    )
    yield running
    await running.stop(0.5)


@pytest.fixture
async def stub(executor: RunningExecutor) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}") as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)

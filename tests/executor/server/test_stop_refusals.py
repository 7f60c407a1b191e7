"""An executor being stopped refuses the calls that reach it with UNAVAILABLE (which clients retry on another
replica), also those that reach it while its event loop is busy: gRPC queues them until the loop asks for the
next call, and the server's final stop cancels whatever is still queued (CANCELLED, which nobody retries). The
stop used to come right after the drain, so a call queued at that moment was lost (a rare failure of
tests/deploy/test_replicas.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc._cython import cygrpc  # channelz: how many calls gRPC's core has taken in, seen without the event loop

from executor_service.server import main as executor_main
from executor_service.server.main import ExecutorOptions, start_executor
from executor_service.server.session import EngineSettings
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

CALLS = 4
WAIT_S = 30.0  # only so that a broken server cannot hang the test


def core_calls_started() -> int:
    """Calls that reached every gRPC server of this process, counted by gRPC's core (channelz), whether or not
    the event loop has picked them up yet."""
    total, start = 0, 0
    while True:
        page = json.loads(cygrpc.channelz_get_servers(start))
        servers = page.get("server", [])
        total += sum(int(server.get("data", {}).get("callsStarted", 0)) for server in servers)
        if page.get("end", True) or not servers:
            return total
        start = max(int(server["ref"]["serverId"]) for server in servers) + 1


def generate(stub: executor_pb2_grpc.ExecutorStub, request_id: str) -> str:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=executor_pb2.SamplingParams(max_tokens=2),
    )
    try:
        list(stub.Generate(request, timeout=WAIT_S))
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "OK"


@pytest.fixture
def client_pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(CALLS) as pool:
        yield pool


async def test_calls_queued_while_the_loop_is_busy_at_the_stop_are_refused_unavailable(
    client_pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A roomy quiet period: CI machines are loaded, and the queued calls must be picked up within it.
    monkeypatch.setattr(executor_main, "STOP_QUIET_S", 1.0)
    executor = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8))
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{executor.server.port}")
    stub = executor_pb2_grpc.ExecutorStub(channel)
    outcomes: list[Future[str]] = []
    drain = executor.servicer.drain
    stopped = False

    async def drain_then_busy(grace_seconds: float) -> None:
        """The drain, then calls that arrive while the loop is held up (as by the engine thread on a loaded
        machine): this blocks the loop until gRPC's core has taken all of them in."""
        await drain(grace_seconds)
        before = core_calls_started()
        outcomes.extend(client_pool.submit(generate, stub, f"late-{i}") for i in range(CALLS))
        # Calls that never reach the server end at their own deadline (WAIT_S): the loop ends then, and the
        # outcomes below say what happened, with no assertion on elapsed time.
        while core_calls_started() < before + CALLS and not all(outcome.done() for outcome in outcomes):
            time.sleep(0.005)

    monkeypatch.setattr(executor.servicer, "drain", drain_then_busy)
    try:
        await asyncio.wait_for(asyncio.to_thread(grpc.channel_ready_future(channel).result), WAIT_S)
        stopped = True
        await executor.stop(0)
        results = [await asyncio.wait_for(asyncio.wrap_future(outcome), WAIT_S) for outcome in outcomes]
    finally:
        channel.close()
        if not stopped:
            await executor.stop(0)
    assert results == ["UNAVAILABLE: the executor is shutting down"] * CALLS

"""The gateway's side of gRPC: one grpc.aio channel to the executors, balanced and retried as the CLI's is
(specdec_runtime.client: round_robin over every address a `dns:///name:port` target resolves to, and a Generate
that fails UNAVAILABLE before its first token retried on another replica), with TLS as the other clients do it.

Tokens: an executor token configured on the gateway (--executor-auth-token, else the gateway's own
--auth-token) goes with every call; without one, the caller's own bearer token is passed through, so that the
executors check it."""

from __future__ import annotations

import argparse
import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_service.grpc_io import coalesce_wakeups
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.auth import bearer_metadata
from specdec_runtime.client import BALANCING_OPTIONS, open_aio_channel

HEALTH_TIMEOUT_S = 5.0
INFO_TIMEOUT_S = 10.0


class Upstream:
    """The executors behind one gRPC target. Create it inside the event loop that uses it."""

    def __init__(self, args: argparse.Namespace, token: str | None) -> None:
        self.target = args.executor
        self.token = token
        self.timeout = args.request_timeout or None
        self.channel = open_aio_channel(
            args.executor,
            args.executor_tls_ca,
            args.executor_tls_cert,
            args.executor_tls_key,
            args.executor_tls_server_name,
            flags="--executor-tls",
            options=BALANCING_OPTIONS,
        )
        self.coalesced = coalesce_wakeups(asyncio.get_running_loop())  # grpc.aio's reader exists once a channel does
        self.executor = executor_pb2_grpc.ExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def metadata(self, caller_token: str | None) -> tuple[tuple[str, str], ...]:
        token = self.token or caller_token
        return bearer_metadata(token) if token else ()

    def generate(self, request: executor_pb2.GenerateRequest, caller_token: str | None) -> grpc.aio.UnaryStreamCall:
        """The Generate stream; cancel() it to abort the request on the executor."""
        return self.executor.Generate(request, metadata=self.metadata(caller_token), timeout=self.timeout)

    async def server_info(self, caller_token: str | None) -> executor_pb2.GetServerInfoResponse:
        request = executor_pb2.GetServerInfoRequest()
        return await self.executor.GetServerInfo(request, metadata=self.metadata(caller_token), timeout=INFO_TIMEOUT_S)

    async def serving(self) -> tuple[bool, str]:
        """Whether an executor answers SERVING (its model loaded and warm), and what it said. Health needs no
        token; round_robin sends each check to the next replica that is up."""
        try:
            answer = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return False, f"{err.code().name}: {err.details() or ''}".strip()
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return answer.status == health_pb2.HealthCheckResponse.SERVING, status

    async def close(self) -> None:
        await self.channel.close()

"""Which service answers at an address, for a call that ended UNIMPLEMENTED: a client pointed at the wrong server
(the selector's address given as the executor's) otherwise reads only "Method not found!". The servers' gRPC
health service (open to callers without a token) knows the names each registers."""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_runtime.client import open_channel_from_args

SERVICES = {"specdec.v1.Executor": "executor", "specdec.v1.BackendSelector": "selector"}
HEALTH_TIMEOUT_S = 5.0


def registered(channel: grpc.Channel, service: str) -> bool | None:
    """Whether the server's health service knows `service` (serving or not); None: it cannot tell (no health
    service, no answer)."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_S
        )
        return True
    except grpc.RpcError as err:
        return False if err.code() == grpc.StatusCode.NOT_FOUND else None


def wrong_service_note(address: str, expected: str, flag: str, args: argparse.Namespace) -> str | None:
    """A line saying what answers at `address` instead of `expected` (a full service name), or None when the
    server does register `expected` or cannot tell."""
    with open_channel_from_args(address, args) as channel:
        if registered(channel, expected) is not False:
            return None
        there = [f"{name} (a specdec {role})" for name, role in SERVICES.items() if registered(channel, name)]
    answering = " and ".join(there) or "neither specdec service"
    return f"{address} is not a specdec {SERVICES[expected]}: {answering} answers there, not {expected} (check {flag})"

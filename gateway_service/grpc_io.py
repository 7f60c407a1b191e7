"""How the gateway's gRPC client does its socket I/O, chosen before grpc is imported (gateway_service.main imports
this module first): grpc reads GRPC_EXPERIMENTS once, when it is imported, and never again.

By default grpc (1.6x on) reads the executors' streams on its EventEngine's threads, which hand each completed read
to grpc.aio's poller thread, which wakes the event loop: two thread hops, with a sleep and a wake-up each, for
every message the executor streams. With the `event_engine_client` experiment off, the poller thread reads the
socket itself: one hop per message, and on the 2-core CPU host the gateway spends about a quarter less CPU per
streamed token (docs/gateway.md, "What the gateway's CPU costs"). Channels, TLS, `dns:///` balancing and
deadlines are the same either way.

GRPC_EXPERIMENTS set in the environment is left as it is (`GRPC_EXPERIMENTS=event_engine_client` keeps grpc's
default). The variable is set only while grpc is imported, so that nothing the process starts inherits it; a
process that has imported grpc already (a test importing the gateway's modules) keeps what it has."""

from __future__ import annotations

import os
import sys

EXPERIMENTS = "-event_engine_client"


def choose_client_io() -> bool:
    """Import grpc with EXPERIMENTS unless grpc is imported already or GRPC_EXPERIMENTS is set; True if it did."""
    if "grpc" in sys.modules or "GRPC_EXPERIMENTS" in os.environ:
        return False
    os.environ["GRPC_EXPERIMENTS"] = EXPERIMENTS
    try:
        import grpc  # noqa: F401  (grpc reads GRPC_EXPERIMENTS now)
    finally:
        del os.environ["GRPC_EXPERIMENTS"]
    return True


CHOSEN = choose_client_io()

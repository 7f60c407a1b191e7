"""`specdec-selector`: run the BackendSelector gRPC server until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from selector_service.grpc_runtime import (
    EnvDefaultsParser,
    RunningServer,
    ServerSettings,
    add_server_arguments,
    create_server,
    start_server,
    wait_for_termination_signal,
)
from selector_service.logs import configure_logging
from selector_service.selection import Selector
from selector_service.servicer import SERVICE_NAME, BackendSelectorServicer
from specdec.v1 import selector_pb2_grpc

DEFAULT_PORT = 50051
log = logging.getLogger("specdec.selector")


async def start_selector(settings: ServerSettings, cache_size: int = 4096) -> RunningServer:
    """Start a selector server and mark it SERVING (it needs no warm-up)."""
    server, metrics = create_server(settings, "selector")
    selector_pb2_grpc.add_BackendSelectorServicer_to_server(BackendSelectorServicer(Selector(cache_size)), server)
    return await start_server(server, metrics, settings, [SERVICE_NAME], ready=True)


async def serve(settings: ServerSettings, cache_size: int) -> None:
    running = await start_selector(settings, cache_size)
    await wait_for_termination_signal()
    await running.stop(settings.grace_seconds)
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = EnvDefaultsParser(prog="specdec-selector", description=__doc__)
    add_server_arguments(parser, DEFAULT_PORT)
    parser.add_argument("--cache-size", type=int, default=4096, help="selection results kept (LRU)")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(serve(ServerSettings.from_args(args), args.cache_size))
    except (OSError, ValueError) as err:  # bad address, unreadable certificate, ...
        log.error("cannot serve: %s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`specdec-selector`: run the BackendSelector gRPC server until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from selection.request import MAX_REQUEST_BYTES
from selection.selector import DEFAULT_CACHE_SIZE, Selector
from selector_service.servicer import SERVICE_NAME, BackendSelectorServicer
from specdec.v1 import selector_pb2_grpc
from specdec_runtime.grpc_runtime import (
    EXIT_BAD_SETUP,
    EnvDefaultsParser,
    RunningServer,
    ServerSettings,
    add_server_arguments,
    create_server,
    start_server,
    wait_for_termination_signal,
)
from specdec_runtime.logs import configure_logging

DEFAULT_PORT = 50051
log = logging.getLogger("specdec.selector")


async def start_selector(settings: ServerSettings, cache_size: int = DEFAULT_CACHE_SIZE) -> RunningServer:
    """Start a selector server and mark it SERVING (it needs no warm-up). Requests larger than the largest
    valid one are refused before they are read (unless --max-message-bytes says otherwise)."""
    server, metrics = create_server(settings, "selector", max_request_bytes=MAX_REQUEST_BYTES)
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
    parser.add_argument(
        "--cache-size", type=_cache_size, default=DEFAULT_CACHE_SIZE, help="selection results kept (LRU)"
    )
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(serve(ServerSettings.from_args(args), args.cache_size))
    except (OSError, ValueError) as err:  # address in use, a TLS key that is not the certificate's, ...
        log.error("cannot serve: %s", err)
        return EXIT_BAD_SETUP
    return 0


def _cache_size(text: str) -> int:
    size = int(text)
    if size < 0:
        raise argparse.ArgumentTypeError(f"{size}: must be >= 0")
    return size


if __name__ == "__main__":
    sys.exit(main())

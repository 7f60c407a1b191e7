"""The gateway's gRPC client, made cheaper per streamed message (docs/gateway.md, "What the gateway's CPU costs").

Its socket I/O is chosen before grpc is imported (gateway_service.main imports this module first): grpc reads
GRPC_EXPERIMENTS once, when it is imported. By default (grpc 1.85, as measured) grpc reads the executors' streams
on its EventEngine's threads, which hand each completed read to grpc.aio's poller thread, which wakes the event
loop: two thread hops, each a sleep and a wake-up, for every message an executor streams. With the
`event_engine_client` experiment off, the poller thread reads the socket itself: one hop. Channels, TLS, `dns:///`
balancing and deadlines are the same either way. GRPC_EXPERIMENTS set in the environment is left as it is
(`GRPC_EXPERIMENTS=event_engine_client` keeps grpc's default). The variable is set only while grpc is imported, so
that nothing the process starts inherits it; a process that has imported grpc already (a test importing the
gateway's modules) keeps what it has.

Then coalesce_wakeups, once the channel exists: one turn of the event loop runs every completion that is ready."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
from typing import Any

EXPERIMENTS = "-event_engine_client"
WAKEUP_PEEK_BYTES = 4096  # wake-up bytes taken at most a turn (more are left for the next turns)


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


def coalesce_wakeups(loop: asyncio.AbstractEventLoop) -> bool:
    """Let one turn of the event loop take every gRPC completion that is ready, not one: True if it could.

    grpc.aio's poller thread queues each completion (a message read, a call's status) and writes one byte to a
    socket pair that the loop watches; the loop's reader reads one byte and runs every completion queued. A burst
    of N messages (an engine step's, one per stream) thus leaves N - 1 bytes behind, and N - 1 more turns of the
    loop, each an epoll_wait, a recv and a reader that finds nothing queued. Here the reader first reads all but
    one of the bytes waiting (any completion whose byte it takes was queued before that byte was written, so it
    is run now), then runs grpc's own reader, which reads the last one. Nothing changes where the loop is not
    asyncio's selector loop or grpc's reader is not found (uvloop, another grpc): grpc's reader stays."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return False
    for key in list(selector.get_map().values()):
        reader = key.data[0] if isinstance(key.data, tuple) else None
        callback = getattr(reader, "_callback", None)
        method = callback.func if isinstance(callback, functools.partial) else callback  # (loop) bound, or not
        owner = getattr(method, "__self__", None)
        if type(owner).__name__ != "PollerCompletionQueue" or getattr(method, "__name__", None) != "_handle_events":
            continue
        sock, args = key.fileobj, tuple(getattr(reader, "_args", None) or ())
        if not isinstance(sock, socket.socket):
            return False

        buffer = bytearray(WAKEUP_PEEK_BYTES)  # read into, never allocated again

        def drain_then_run(
            sock: socket.socket = sock, callback: Any = callback, args: tuple = args, buffer: bytearray = buffer
        ) -> None:
            try:
                waiting = sock.recv_into(buffer, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return  # woken for nothing: grpc's reader would block on its recv
            if waiting > 1:
                sock.recv_into(buffer, waiting - 1)
            callback(*args)

        loop.remove_reader(sock)
        loop.add_reader(sock, drain_then_run)
        return True
    return False

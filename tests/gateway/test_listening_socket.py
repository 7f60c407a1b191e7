"""The gateway's connections send small writes at once (TCP_NODELAY): without it a stream's first event waited for
the client's delayed ACK, 40 ms on Linux, on every request."""

from __future__ import annotations

import socket

from gateway_service.main import listening_socket


def test_accepted_connections_have_tcp_nodelay() -> None:
    server = listening_socket("127.0.0.1", 0)
    try:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.close()

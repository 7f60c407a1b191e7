"""A raw HTTP request to the gateway left open mid-stream, for the tests of what a caller that goes away causes
(imported as `gateway_streams`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import socket

from gateway_stack import TOKEN

LONG = 4000  # tokens a request asks for: minutes of work for nobody if the abort did not happen
NO_HANG_S = 120.0


def open_request(address: str, body: dict) -> socket.socket:
    """A POST /v1/completions on a plain socket, so that the test can close it mid-answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(address.split(":"), timeout=NO_HANG_S)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock

"""Reading a request body within a size bound and parsing it as one JSON object.

The bound is checked against Content-Length before anything is read, and again while the body streams in (a
chunked body has no length), so a caller cannot make the gateway hold more than the bound in memory. The bound
follows the executor's own largest valid Generate (8 MiB of chat content or text) plus room for JSON escapes."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive

from gateway_service.errors import ApiError
from gateway_service.generation import Disconnected

MiB = 1 << 20
# The executor accepts 8 MiB of text or chat content; JSON escapes (\n, \", \uXXXX) make a body larger than that.
DEFAULT_MAX_BODY_BYTES = 16 * MiB


async def read_json_object(headers: list[tuple[bytes, bytes]], receive: Receive, max_bytes: int) -> dict[str, Any]:
    """The body of an ASGI request (its scope's headers, its receive) as a JSON object; ApiError 413 when larger
    than `max_bytes`, 400 when it is not a JSON object; Disconnected when the caller leaves before its end."""
    declared = next((value for name, value in headers if name == b"content-length"), None)
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise _too_large(max_bytes)
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise Disconnected
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return parse_json_object(chunks[0] if len(chunks) == 1 else b"".join(chunks))


def parse_json_object(data: bytes) -> dict[str, Any]:
    """One JSON object. NaN and the infinities (which Python's json reads, and JSON has not) stay floats here,
    so that the field checks refuse them naming the field they were sent in."""
    try:
        value = json.loads(data)
    except RecursionError:  # the C parser guards its recursion: deep nesting is refused, never a crash
        raise ApiError(400, "the body nests JSON too deeply", code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError, as are 5000-digit ints
        raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(value).__name__}", code="invalid_json")
    return value


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")

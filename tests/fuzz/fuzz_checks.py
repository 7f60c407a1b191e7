"""What every fuzzed call must satisfy, whatever its input: a status a client can act on (never INTERNAL or
UNKNOWN, never a hang), an INVALID_ARGUMENT that names the request's field, a short message, and an engine
that holds nothing once the calls are over."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from rpc_details import field_violations

# A bug (INTERNAL, UNKNOWN), a hang (DEADLINE_EXCEEDED: every call has a generous deadline) or a server that
# went away (UNAVAILABLE, DATA_LOSS) is never a valid answer to a request, however bad.
NEVER = frozenset(
    {
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
MAX_MESSAGE_CHARS = 4096  # bad input is echoed truncated, so a refusal stays far below the 8 KiB metadata limit
SHOWN_CHARS, SHOWN_ITEMS = 48, 6
IDLE_TIMEOUT_S = 30.0  # a no-hang bound, not a performance bar
ENGINE_GAUGES = ("specdec_running_requests", "specdec_queue_depth", "specdec_kv_blocks_used")
_INDEX = re.compile(r"\[\d+\]$")


def shown(message: Message) -> str:
    """The message as JSON with long strings and lists cut, for failure reports (inputs may be megabytes)."""
    return repr(_cut(json_format.MessageToDict(message, preserving_proto_field_name=True)))


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} chars)"
    if isinstance(value, list):
        head = [_cut(v) for v in value[:SHOWN_ITEMS]]
        return head if len(value) <= SHOWN_ITEMS else [*head, f"... ({len(value)} items)"]
    if isinstance(value, dict):
        return {k: _cut(v) for k, v in value.items()}
    return value


class Shown:
    """A request drawn by hypothesis, printed cut short when an example fails."""

    def __init__(self, message: Message) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self.message).__name__}({shown(self.message)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints a failing example
        printer.text(repr(self))


def names_a_field(descriptor: Descriptor, path: str) -> bool:
    """Whether a violation's dotted path starts at a field (or oneof) of the request. Past a scalar field the
    path may go on into what that field names (e.g. "target.path.vocab_size": a key of the config.json at
    target.path); inside a message every part must be one of its fields."""
    current: Descriptor | None = descriptor
    for part in path.split("."):
        if current is None:  # inside a scalar: the rest names something the field points to
            return True
        name = _INDEX.sub("", part)
        if name in current.fields_by_name:
            current = current.fields_by_name[name].message_type
        elif name in current.oneofs_by_name:
            current = None
        else:
            return False
    return True


def check_refusal(err: grpc.RpcError, request: Message, method: str) -> None:
    """A refused call: a status that says what to do, a short message, and for INVALID_ARGUMENT the
    offending fields of `request` in google.rpc.BadRequest."""
    code, details = err.code(), err.details() or ""
    where = f"{method} answered {code.name} {details[:300]!r} to {shown(request)}"
    assert code not in NEVER, where
    assert not (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata" in details.lower()), (
        f"the refusal's metadata overflowed the client's limit (bad input echoed whole?): {where}"
    )
    assert len(details) <= MAX_MESSAGE_CHARS, f"a {len(details)}-character status message: {where}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = field_violations(err)
        assert violations, f"INVALID_ARGUMENT without google.rpc.BadRequest field violations: {where}"
        descriptor = request.DESCRIPTOR
        for violation in violations:
            assert violation.field and violation.description, f"an empty field violation {violation}: {where}"
            assert names_a_field(descriptor, violation.field), (
                f"field violation {violation.field!r} names no field of {descriptor.name}: {where}"
            )


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's Prometheus samples without labels, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            samples[name] = float(value)
    return samples


def wait_until_idle(metrics_port: int, context: str = "") -> Mapping[str, float]:
    """Wait until the engine holds no request and no KV block (its gauges read 0); fails after a generous bound."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        samples = scrape(metrics_port)
        gauges = {name: samples.get(name) for name in ENGINE_GAUGES}
        if all(value == 0 for value in gauges.values()):
            return samples
        assert time.monotonic() < deadline, f"the engine still holds {gauges} {IDLE_TIMEOUT_S} s later {context}"
        time.sleep(0.02)

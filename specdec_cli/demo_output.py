"""Where `specdec demo` writes: the text report on stdout (or one JSON document with --json), progress and
errors on stderr. Progress is a live spinner on a terminal and a few plain lines elsewhere (logs, CI)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

SPINNER = "|/-\\"
FRAME_S = 0.1
HEALTH_POLL_S = 0.5
PLAIN_PROGRESS_EVERY_S = 10.0
HEALTH = health_pb2.HealthCheckResponse.ServingStatus


class Output:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.report: dict[str, Any] = {}
        self.step = "starting"  # the call under way, named in error messages
        self.line_open = False  # stream() left stdout mid-line

    def section(self, title: str) -> None:
        self.end_line()
        if not self.as_json:
            print(f"\n== {title}", flush=True)

    def line(self, text: str) -> None:
        self.end_line()
        if not self.as_json:
            print(text, flush=True)

    def stream(self, text: str) -> None:
        """Part of a line, shown at once (generated tokens as they arrive)."""
        if not self.as_json and text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        """End a line stream() left open, so that what follows (an error after Ctrl-C) starts a line of its own."""
        if self.line_open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.line_open = False

    def error(self, text: str) -> None:
        """On stderr; with --json the document carries the errors too."""
        self.end_line()
        print(text, file=sys.stderr, flush=True)
        if self.as_json:
            self.report.setdefault("errors", []).append(text)

    def record(self, key: str, value: Message | object) -> None:
        """Keep `value` for the JSON document (messages in the protobuf JSON mapping)."""
        if isinstance(value, Message):
            value = json_format.MessageToDict(value, always_print_fields_with_no_presence=True)
        self.report[key] = value

    def finish(self) -> None:
        if self.as_json:
            print(json.dumps(self.report, indent=2), flush=True)

    def wait_with_progress(self, future: grpc.Future, label: str, health: Callable[[], int]) -> Any:
        """The future's result, showing elapsed time and the executor's health while it runs."""
        interactive = sys.stderr.isatty()
        started = last_poll = last_plain = time.monotonic()
        status = _poll(health)
        if not interactive:
            _progress(f"{label}... (executor health {status})")
        frame = 0
        try:
            while not future.done():
                now = time.monotonic()
                if now - last_poll >= HEALTH_POLL_S:
                    status, last_poll = _poll(health), now
                if interactive:
                    spinner = SPINNER[frame % len(SPINNER)]
                    sys.stderr.write(f"\r{spinner} {label} {now - started:5.1f} s  (executor health {status})  ")
                    sys.stderr.flush()
                elif now - last_plain >= PLAIN_PROGRESS_EVERY_S:
                    _progress(f"{label}: {now - started:.0f} s (executor health {status})")
                    last_plain = now
                frame += 1
                time.sleep(FRAME_S)
        except KeyboardInterrupt:
            future.cancel()
            raise
        finally:
            if interactive:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
        return future.result()


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _poll(health: Callable[[], int]) -> str:
    try:
        return HEALTH.Name(health())
    except grpc.RpcError as err:
        return f"unknown: {err.code().name}"  # type: ignore[attr-defined]

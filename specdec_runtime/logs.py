"""Structured logging: one JSON object per line (or plain text for humans at a terminal).

Lines stay short whatever a caller sent: the message and each field are clipped to MAX_FIELD_CHARS
(a traceback to MAX_TRACEBACK_CHARS), so a request that echoes a megabyte is not logged a megabyte at a time.
"""

from __future__ import annotations

import json
import logging
import sys
import time

MAX_FIELD_CHARS = 1024
MAX_TRACEBACK_CHARS = 16384

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _short(value: object, limit: int = MAX_FIELD_CHARS) -> object:
    """`value`, or for a long string (or a value whose str() is long) its head and its length."""
    text = value if isinstance(value, str) else None
    if text is None and not isinstance(value, (int, float, bool, type(None))):
        text = str(value)
    if text is None or len(text) <= limit:
        return value
    return f"{text[:limit]}... ({len(text)} characters)"


def _extras(record: logging.LogRecord) -> dict[str, object]:
    """The fields a call passed with `extra=`, each clipped."""
    return {k: _short(v) for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON; `extra=` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _short(record.getMessage()),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = _short(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = str(_short(record.message))
        return super().formatMessage(record)

    def formatException(self, ei: object) -> str:
        return str(_short(super().formatException(ei), MAX_TRACEBACK_CHARS))  # type: ignore[arg-type]

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        return f"{line} {extras}" if extras else line


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Route every logger to stderr in the chosen format ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

"""Typed reads of a checkpoint's JSON files (config.json, generation_config.json, the shard index).

These files come from anywhere: a value of the wrong type, a file that is a directory or a FIFO, or one of a
gigabyte must be an INVALID_ARGUMENT naming the field, not a TypeError deep in the loader. Each read records
a violation and returns a default, so every bad key is reported at once.
"""

from __future__ import annotations

import json
import math
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from executor_service.errors import FieldProblem, InvalidField, invalid_fields
from executor_service.models.limits import short_repr, size_violation

MAX_JSON_BYTES = 16 << 20  # config files are kilobytes; a shard index of a very large model about a megabyte


def read_json_object(path: Path, field: str) -> dict[str, Any]:
    """The JSON object in `path`, a regular file of at most MAX_JSON_BYTES (`field`: the request field that
    named its directory); FileNotFoundError when it does not exist."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise invalid_fields([FieldProblem(field, f"{path.name} cannot be read: {_reason(err)}")]) from None
    if not stat.S_ISREG(info.st_mode):
        raise invalid_fields([FieldProblem(field, f"{path.name} is not a regular file")])
    if info.st_size > MAX_JSON_BYTES:
        raise invalid_fields([FieldProblem(field, f"{path.name} is {info.st_size} bytes, over {MAX_JSON_BYTES}")])
    try:
        raw = json.loads(path.read_bytes())
    except OSError as err:
        raise invalid_fields([FieldProblem(field, f"{path.name} cannot be read: {_reason(err)}")]) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise invalid_fields(
            [FieldProblem(field, f"{path.name} is not valid JSON: {short_repr(str(err), 120)}")]
        ) from None
    if not isinstance(raw, dict):
        raise invalid_fields([FieldProblem(field, f"{path.name} must hold a JSON object, not {type(raw).__name__}")])
    return raw


def in_file(violations: Iterable[FieldProblem], file_name: str) -> InvalidField:
    """The violations found in one file, each description saying which file."""
    return invalid_fields([FieldProblem(v.field, f"{file_name}: {v.description}") for v in violations])


def _reason(err: BaseException) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__


class FieldReader:
    """Reads keys of one JSON object; a bad value becomes a violation named `<prefix>.<key>`."""

    def __init__(self, raw: dict[str, Any], prefix: str) -> None:
        self.raw, self.prefix = raw, prefix
        self.violations: list[FieldProblem] = []

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}"

    def bad(self, key: str, description: str) -> None:
        self.violations.append(FieldProblem(self.name(key), description))

    def integer(self, key: str, default: int, maximum: int, minimum: int = 1) -> int:
        """An integer in [minimum, maximum]; `default` when absent or null."""
        value = self.raw.get(key)
        if value is None:
            return default
        violation = size_violation(self.name(key), value, maximum, minimum)
        if violation is not None:
            self.violations.append(violation)
            return default
        return value

    def number(self, key: str, default: float, positive: bool = True) -> float:
        """A finite number (positive unless told otherwise); `default` when absent or null."""
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.bad(key, f"a finite number is required, got {short_repr(value)}")
            return default
        if positive and value <= 0:
            self.bad(key, f"must be positive, got {value}")
            return default
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.bad(key, f"true or false, got {short_repr(value)}")
            return default
        return value

    def object(self, key: str) -> dict[str, Any]:
        """A nested object ({} when absent or null)."""
        value = self.raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.bad(key, f"a JSON object is required, got {short_repr(value)}")
            return {}
        return value

    def integers(self, key: str, maximum: int, minimum: int = 0) -> tuple[int, ...]:
        """One integer or a list of them, each in [minimum, maximum] (() when absent or null)."""
        value = self.raw.get(key)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum for v in values):
            self.bad(key, f"an integer or a list of integers in [{minimum}, {maximum}], got {short_repr(value)}")
            return ()
        return tuple(values)

    def strings(self, key: str) -> list[str]:
        """A list of strings ([] when absent or null)."""
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.bad(key, f"a list of strings is required, got {short_repr(value)}")
            return []
        return value

    def string(self, key: str) -> str:
        value = self.raw.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            self.bad(key, f"a string is required, got {short_repr(value)}")
            return ""
        return value

"""Typed reads of a JSON object's fields, each refusal a 400 that names the field (`param`).

JSON gives a caller every type for every field; the gRPC message behind it takes one. A bool is not a number
here (Python says it is), a float with a fraction is not an integer, NaN and the infinities are not numbers,
and integers are bounded to what their protobuf field holds, so nothing is silently wrapped or truncated.
`null` means "not given", as in OpenAI's API. Values are echoed only by type and length, never in full."""

from __future__ import annotations

import math
from typing import Any

from gateway_service.errors import bad_field
from specdec_runtime.errors import echo

INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class Fields:
    """The fields of one JSON object; each read records the name, and `refuse_unknown` refuses the rest."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix
        self.read: set[str] = set()

    def param(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def raw(self, name: str) -> Any:
        """The value as sent; None when absent or null."""
        self.read.add(name)
        return self.data.get(name)

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)  # 16.0: JSON has one number type, and some clients write integers so
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_field(self.param(name), f"must be an integer, got {_kind(value)}")
        if not low <= value <= high:
            raise bad_field(self.param(name), f"must be in [{low}, {high}], got {_number(value)}")
        return value

    def number(self, name: str) -> float | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_field(self.param(name), f"must be a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise bad_field(self.param(name), f"must be a finite number, got {value}")
        return float(value)

    def boolean(self, name: str) -> bool | None:
        value = self.raw(name)
        if value is not None and not isinstance(value, bool):
            raise bad_field(self.param(name), f"must be true or false, got {_kind(value)}")
        return value

    def string(self, name: str, max_chars: int) -> str | None:
        value = self.raw(name)
        if value is None:
            return None
        return checked_string(value, self.param(name), max_chars)

    def object(self, name: str) -> Fields | None:
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_field(self.param(name), f"must be an object, got {_kind(value)}")
        return Fields(value, f"{self.param(name)}.")

    def refuse_unknown(self, neutral: dict[str, Any] | None = None) -> None:
        """400 for the first field not read. `neutral`: OpenAI fields this service does not implement, accepted
        only with the value that asks for nothing (tools: [], response_format: {"type": "text"})."""
        if len(self.read) >= len(self.data) and self.read.issuperset(self.data):
            return  # every field read: the common case, without a loop
        for name, value in self.data.items():
            if name in self.read:
                continue
            if neutral and name in neutral:
                if value is None or value == neutral[name]:
                    continue
                raise bad_field(self.param(name), f"is not supported by specdec (only {neutral[name]!r} or null)")
            raise bad_field(self.param(echo(name, 40).strip("'")), "unknown field")


def checked_string(value: Any, param: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise bad_field(param, f"must be a string, got {_kind(value)}")
    if len(value) > max_chars:
        raise bad_field(param, f"is {len(value)} characters long; at most {max_chars}")
    return value


def _kind(value: Any) -> str:
    """What a value is, for a message: its JSON type and size, never the value itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {_number(value)}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    return "an object"


def _number(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"

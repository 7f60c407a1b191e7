"""Hypothesis strategies that build any request message from its proto descriptor.

Every field gets hostile values of its wire type: huge, tiny and negative numbers, NaN and infinities, long
strings and strings with NUL bytes, unknown enum numbers, empty and oversize repeated fields, oneofs set or
not. `overrides` maps a dotted field path (e.g. "sampling.temperature") to a hand-written strategy for that
field, so a test mixes the shapes that matter to a service with the blind values of every other field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from kernels.capabilities import BACKENDS

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Small values (where real requests live) and the edges of the type. Nothing in between: a mid-sized value in
# every shape field would make a model that is valid, gigabytes large and minutes to build.
INT32_EDGES = (INT32_MIN, INT32_MIN + 1, -(2**30), -1, 0, 1, 2**30, 2**31 - 2, INT32_MAX)
INT64_EDGES = (INT64_MIN, -(2**32), -1, 0, 1, 2**32, 2**53 + 1, INT64_MAX)
UINT64_EDGES = (0, 1, 2**31, 2**32, 2**53 + 1, 2**64 - 1)
FLOAT_EDGES = (0.0, -0.0, 1e-45, 1e-38, -1e-38, 1.0, -1.0, 0.5, 1e38, -1e38, 3.4e38, math.inf, -math.inf, math.nan)
ODD_STRINGS = ("", " ", "\x00", "a\x00b", "..", "../..", "/", "/etc/passwd", "é" * 3, "\u202e", "💥", "\t\n")
LONG_STRING_LENGTHS = (255, 256, 4097, 10_000, 1 << 20)  # 1 MiB: past any sane name, under the message limits
OVERSIZE_REPEATS = (1_000, 100_000)
# Attention backend names as the services spell them, in other cases, padded, and with a NUL.
BACKEND_NAMES = ("", "auto", *BACKENDS, *(name.lower() for name in BACKENDS), " cpu_attn ", "FLASH_ATTN\x00")


def int32s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 64), st.sampled_from(INT32_EDGES))


def int64s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-3, 64), st.sampled_from(INT64_EDGES))


def uint64s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 1 << 40), st.sampled_from(UINT64_EDGES))


def floats32() -> st.SearchStrategy[float]:
    """float fields: values a float32 holds, subnormals, the largest, infinities and NaN."""
    return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32, allow_nan=True, allow_infinity=True))


def doubles() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(allow_nan=True, allow_infinity=True))


def long_strings() -> st.SearchStrategy[str]:
    """Long strings, built in one go (drawing a million characters one by one would take minutes)."""
    return st.builds(lambda n, c: (c * n)[:n], st.sampled_from(LONG_STRING_LENGTHS), st.sampled_from(("x", "é", "\0")))


def short_strings() -> st.SearchStrategy[str]:
    """Odd short strings and arbitrary short text, NUL included (UTF-8 encodable: no lone surrogates)."""
    return st.one_of(st.sampled_from(ODD_STRINGS), st.text(st.characters(exclude_categories=("Cs",)), max_size=24))


def strings(known: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """Known good values of the field (if any), odd short strings and long ones."""
    parts = [short_strings(), long_strings()]
    if known:
        parts.insert(0, st.sampled_from(known))
    return st.one_of(parts)


def oversize(element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A repeated field of many copies of one element: cheap to draw, heavy to send."""
    return st.builds(lambda n, value: [value] * n, st.sampled_from(OVERSIZE_REPEATS), element)


def repeated(field: FieldDescriptor, element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """A few elements, or (scalars only) thousands of copies of a short one: a long string copied 100,000
    times would be 100 GB."""
    small = st.lists(element, max_size=4)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return small
    short = short_strings() if field.type == FieldDescriptor.TYPE_STRING else element
    return st.one_of(small, oversize(short))


def enums(field: FieldDescriptor) -> st.SearchStrategy[int]:
    """Declared numbers and unknown ones (proto3 enums are open: any int32 arrives as is)."""
    known = tuple(v.number for v in field.enum_type.values)
    return st.one_of(st.sampled_from(known), st.sampled_from((-1, max(known) + 1, INT32_MAX)))


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return int32s()
    if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return int64s()
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return uint64s()
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 64), st.sampled_from((2**31, 2**32 - 1)))
    if kind == FieldDescriptor.TYPE_FLOAT:
        return floats32()
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return doubles()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return strings()
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_ENUM:
        return enums(field)
    raise TypeError(f"no strategy for {field.full_name} (type {kind})")


def real_oneof(field: FieldDescriptor) -> str | None:
    """The name of the field's real oneof; None for plain fields and proto3 `optional` (a synthetic oneof)."""
    oneof = field.containing_oneof
    if oneof is None or (len(oneof.fields) == 1 and oneof.name == f"_{field.name}"):
        return None
    return oneof.name


def messages(
    message_class: type[Message],
    overrides: Mapping[str, st.SearchStrategy[Any]] | None = None,
    max_depth: int = 4,
) -> st.SearchStrategy[Message]:
    """Any message of `message_class`: each field left unset or drawn (overrides by dotted path win)."""
    return _message(message_class.DESCRIPTOR, message_class, dict(overrides or {}), "", max_depth)


def _message(
    descriptor: Descriptor,
    message_class: type[Message],
    overrides: dict[str, st.SearchStrategy[Any]],
    prefix: str,
    depth: int,
) -> st.SearchStrategy[Message]:
    plain = [f for f in descriptor.fields if real_oneof(f) is None]
    oneofs: dict[str, list[FieldDescriptor]] = {}
    for f in descriptor.fields:
        if (name := real_oneof(f)) is not None:
            oneofs.setdefault(name, []).append(f)
    field_strategies = {f.name: _field(f, overrides, prefix, depth) for f in descriptor.fields}

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = message_class()
        for f in plain:
            if draw(st.booleans()):
                _assign(message, f, draw(field_strategies[f.name]))
        for members in oneofs.values():
            chosen = draw(st.sampled_from([None, *members]))
            if chosen is not None:
                _assign(message, chosen, draw(field_strategies[chosen.name]))
        return message

    return build()


def _field(
    field: FieldDescriptor, overrides: dict[str, st.SearchStrategy[Any]], prefix: str, depth: int
) -> st.SearchStrategy[Any]:
    path = f"{prefix}{field.name}"
    if path in overrides:
        return overrides[path]
    is_message = field.type == FieldDescriptor.TYPE_MESSAGE
    if is_message:
        if depth <= 0:
            return st.just([] if field.is_repeated else None)
        sub = field.message_type
        element = _message(sub, GetMessageClass(sub), overrides, f"{path}.", depth - 1)
    else:
        element = scalar(field)
    return repeated(field, element) if field.is_repeated else element


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    if value is None:
        return
    target = getattr(message, field.name)
    if field.is_repeated:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def leaf_fields(descriptor: Descriptor, prefix: str = "", depth: int = 4) -> list[tuple[str, FieldDescriptor]]:
    """Every field that is not a singular sub-message (those are walked into), by dotted path."""
    found: list[tuple[str, FieldDescriptor]] = []
    for f in descriptor.fields:
        path = f"{prefix}{f.name}"
        if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated and depth > 0:
            found += leaf_fields(f.message_type, f"{path}.", depth - 1)
        else:
            found.append((path, f))
    return found


def near(
    base: st.SearchStrategy[Message],
    overrides: Mapping[str, st.SearchStrategy[Any]] | None = None,
    max_changes: int = 3,
) -> st.SearchStrategy[Message]:
    """A valid request from `base` with one to `max_changes` fields replaced by hostile values: the shapes
    that pass most checks and reach the code behind them."""
    table = dict(overrides or {})

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = type(original := draw(base))()
        message.CopyFrom(original)
        leaves = leaf_fields(message.DESCRIPTOR)
        picked = draw(st.lists(st.sampled_from(leaves), min_size=1, max_size=max_changes))
        for path, field in dict(picked).items():  # a field drawn twice is changed once
            prefix = path[: -len(field.name)]
            _set_path(message, path, field, draw(_field(field, table, prefix, 2)))
        return message

    return build()


def _set_path(message: Message, path: str, field: FieldDescriptor, value: Any) -> None:
    holder = message
    for name in path.split(".")[:-1]:
        holder = getattr(holder, name)
    if field.is_repeated:
        holder.ClearField(field.name)
    if value is None:
        holder.ClearField(field.name)
    else:
        _assign(holder, field, value)

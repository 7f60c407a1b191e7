"""Size bounds on request messages: every string and repeated field, checked before anything reads them.

Without a bound, a caller's 1 MiB backend name is parsed, echoed in errors, logged and kept in caches. The
same bounds give the largest valid request (`largest_message`), from which a server's message limit follows:
anything larger is refused by gRPC before it is read.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from specdec_runtime.errors import FieldViolation

MAX_STRING_BYTES = 256  # names, versions, architectures, ids: far more than any real one
MAX_REPEATED = 64  # entries of a repeated field without a bound of its own

# A value of each scalar type at its longest encoding (a negative int32 is sign-extended to 10 varint bytes).
_LONGEST = {
    FieldDescriptor.TYPE_DOUBLE: 1.0,
    FieldDescriptor.TYPE_FLOAT: 1.0,
    FieldDescriptor.TYPE_FIXED32: 1,
    FieldDescriptor.TYPE_FIXED64: 1,
    FieldDescriptor.TYPE_SFIXED32: 1,
    FieldDescriptor.TYPE_SFIXED64: 1,
    FieldDescriptor.TYPE_BOOL: True,
    FieldDescriptor.TYPE_UINT32: (1 << 32) - 1,
    FieldDescriptor.TYPE_UINT64: (1 << 64) - 1,
    FieldDescriptor.TYPE_INT32: -1,
    FieldDescriptor.TYPE_INT64: -1,
    FieldDescriptor.TYPE_SINT32: -(1 << 31),
    FieldDescriptor.TYPE_SINT64: -(1 << 63),
}


def size_violations(
    message: Message,
    limits: Mapping[str, int] | None = None,
    max_string_bytes: int = MAX_STRING_BYTES,
    max_repeated: int = MAX_REPEATED,
) -> list[FieldViolation]:
    """Every field of `message` (nested ones too) over its bound: strings and bytes in bytes, repeated fields
    in entries. `limits` overrides the bound of a field by its path without indices (e.g.
    {"speculative.dflash_config.target_layer_ids": 1024}). The values themselves are not echoed."""
    found: list[FieldViolation] = []
    _check(message, "", "", limits or {}, max_string_bytes, max_repeated, found)
    return found


def _check(
    message: Message,
    path: str,
    schema: str,
    limits: Mapping[str, int],
    max_string_bytes: int,
    max_repeated: int,
    found: list[FieldViolation],
) -> None:
    for field, value in message.ListFields():
        where, kind = f"{path}{field.name}", f"{schema}{field.name}"
        if _is_repeated(field):
            bound = limits.get(kind, max_repeated)
            if len(value) > bound:
                found.append(FieldViolation(where, f"{len(value)} entries; at most {bound}"))
                continue
            items = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
        else:
            items = [(where, value)]
        for item_path, item in items:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                _check(item, f"{item_path}.", f"{kind}.", limits, max_string_bytes, max_repeated, found)
            elif field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                bound = limits.get(kind, max_string_bytes)
                size = len(item) if isinstance(item, bytes) else len(item.encode("utf-8"))
                if size > bound:
                    found.append(FieldViolation(item_path, f"{size} bytes long; at most {bound}"))


def largest_message(
    message_type: type[Message],
    limits: Mapping[str, int] | None = None,
    max_string_bytes: int = MAX_STRING_BYTES,
    max_repeated: int = MAX_REPEATED,
) -> Message:
    """A message of `message_type` with every field at its largest wire size within the bounds: each string
    at its bound, each repeated field full, each number at its longest encoding. Its ByteSize() is at least
    that of any message `size_violations` accepts."""
    message = message_type()
    _fill(message, "", limits or {}, max_string_bytes, max_repeated)
    return message


def _fill(message: Message, schema: str, limits: Mapping[str, int], max_string_bytes: int, max_repeated: int) -> None:
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and len(oneof.fields) > 1:  # a real oneof: its largest member alone
            if message.WhichOneof(oneof.name) is None:
                _fill_largest_member(message, oneof.fields, schema, limits, max_string_bytes, max_repeated)
            continue
        _fill_field(message, field, schema, limits, max_string_bytes, max_repeated)


def _fill_field(
    message: Message,
    field: FieldDescriptor,
    schema: str,
    limits: Mapping[str, int],
    max_string_bytes: int,
    max_repeated: int,
) -> None:
    kind = f"{schema}{field.name}"
    repeated = _is_repeated(field)
    count = limits.get(kind, max_repeated) if repeated else 1
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if repeated:
            targets = [getattr(message, field.name).add() for _ in range(count)]
        else:
            getattr(message, field.name).SetInParent()
            targets = [getattr(message, field.name)]
        for target in targets:
            _fill(target, f"{kind}.", limits, max_string_bytes, max_repeated)
        return
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        text = "x" * limits.get(kind, max_string_bytes)
        value: object = text if field.type == FieldDescriptor.TYPE_STRING else text.encode()
    elif field.type == FieldDescriptor.TYPE_ENUM:
        value = max(v.number for v in field.enum_type.values)
    else:
        value = _LONGEST[field.type]
    if repeated:
        getattr(message, field.name).extend([value] * count)
    else:
        setattr(message, field.name, value)


def _fill_largest_member(
    message: Message,
    members: list[FieldDescriptor],
    schema: str,
    limits: Mapping[str, int],
    max_string_bytes: int,
    max_repeated: int,
) -> None:
    candidates = []
    for member in members:
        candidate = type(message)()
        _fill_field(candidate, member, schema, limits, max_string_bytes, max_repeated)
        candidates.append((candidate.ByteSize(), member.name, candidate))
    _, _, largest = max(candidates, key=lambda c: c[0])
    message.MergeFrom(largest)


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated

"""Requests protobuf cannot decode: the string field holding invalid UTF-8, named by walking the
request's wire format against its descriptor (gRPC alone answers INTERNAL "Exception deserializing
request!" and logs a traceback per request)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


class Undecodable:
    """What the request deserializer returns for bytes protobuf refuses; the handler answers it
    with INVALID_ARGUMENT. (A deserializer that raises makes gRPC answer INTERNAL "Exception
    deserializing request!" and log a traceback per request.)"""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def invalid_utf8_field(desc: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The path (``events[2].stored.x``) of the first string field in ``data`` (a serialized
    ``desc`` message) that is not valid UTF-8; None when there is none or the bytes are not
    well-formed protobuf (then the caller names no field)."""
    pos, seen = 0, dict[int, int]()
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                n, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + n], pos + n
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                i = seen[number] = seen.get(number, -1) + 1
                name = f"{field.name}[{i}]" if field.is_repeated else field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 32:
                    inner = invalid_utf8_field(field.message_type, chunk, depth + 1)
                    if inner is not None:
                        return f"{name}.{inner}"
            else:
                return None  # groups or garbage: give up naming a field
    except (IndexError, ValueError):
        return None
    return None


def checked_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Wraps a ``Message.FromString``: a DecodeError becomes an :class:`Undecodable` naming the field."""
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)
    desc = getattr(message_class, "DESCRIPTOR", None)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            name = desc.full_name if desc is not None else "request"
            field = invalid_utf8_field(desc, data) if desc is not None else None
            if field is not None:
                return Undecodable(f"{field} is not valid UTF-8: string fields of {name} must be UTF-8 text")
            return Undecodable(f"the request is not a valid {name} message (protobuf could not decode it)")

    return deserialize

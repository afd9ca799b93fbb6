"""Write GGUF files byte by byte, including ones no honest writer would produce.

gguf.GGUFWriter refuses what a hostile file does (wrong types, lying counts,
misplaced tensors). Tests of the reader and the model-file fuzzer need those
files, so this module serializes a GGUF from plain parts and records where
each number went (``Slot``), so a caller can overwrite any count, length,
type or offset afterwards.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from kvserve.loader.gguf_reader import read_gguf
from kvserve.loader.gguf_types import GGUFFile

V = GGUFValueType

_SCALAR_FORMATS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<B",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


@dataclass(frozen=True)
class KeyValue:
    """A metadata entry. value: bytes/str for STRING, a list for ARRAY, a number otherwise.

    An array of arrays lists ``(item_type, items)`` pairs. The name may be raw bytes.
    """

    name: str | bytes
    value_type: int
    value: Any
    item_type: int | None = None


@dataclass(frozen=True)
class TensorPart:
    """A tensor table entry and its bytes. shape is in ggml order; offset None = packed."""

    name: str | bytes
    shape: tuple[int, ...]
    tensor_type: int
    data: bytes
    offset: int | None = None


@dataclass(frozen=True)
class Slot:
    """Where a number of the header was written: ``size`` bytes at ``offset``."""

    offset: int
    size: int
    what: str
    signed: bool = False


@dataclass
class GGUFParts:
    """Everything a GGUF file holds, as editable parts."""

    key_values: list[KeyValue]
    tensors: list[TensorPart]
    alignment: int = 32
    version: int = 3
    slots: list[Slot] = field(default_factory=list)

    def with_value(
        self, name: str, value_type: int, value: Any, item_type: int | None = None
    ) -> GGUFParts:
        """A copy with metadata ``name`` replaced (or added) by the given value."""
        entry = KeyValue(name, value_type, value, item_type)
        key_values = [kv for kv in self.key_values if kv.name != name]
        return replace(self, key_values=[*key_values, entry], slots=[])

    def without(self, name: str) -> GGUFParts:
        """A copy without metadata ``name``."""
        return replace(self, key_values=[kv for kv in self.key_values if kv.name != name], slots=[])


def parts_of(path: Path) -> GGUFParts:
    """The parts of a valid GGUF file (read with kvserve's reader)."""
    parsed: GGUFFile = read_gguf(path)
    key_values = []
    for field_ in parsed.fields.values():
        raw = field_.raw
        if field_.value_type == V.ARRAY and field_.item_type != V.STRING:
            raw = raw.tolist()
        key_values.append(KeyValue(field_.name, int(field_.value_type), raw, field_.item_type))
    tensors = [
        TensorPart(t.name, t.shape, int(t.tensor_type), t.data.tobytes()) for t in parsed.tensors
    ]
    return GGUFParts(key_values, tensors, parsed.alignment, parsed.version)


def serialize(parts: GGUFParts) -> bytes:
    """The file's bytes; ``parts.slots`` is refilled with where each number went."""
    out = bytearray(b"GGUF")
    slots: list[Slot] = []

    def number(fmt: str, value: Any, what: str) -> None:
        size = struct.calcsize(fmt)
        slots.append(Slot(len(out), size, what, signed=fmt[-1] in "bhiq"))
        out.extend(struct.pack(fmt, value))

    def string(value: bytes | str, what: str) -> None:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        number("<Q", len(data), f"length of {what}")
        out.extend(data)

    def value(value_type: int, item: Any, what: str, item_type: int | None) -> None:
        if value_type == V.STRING:
            string(item, what)
        elif value_type == V.ARRAY:
            assert item_type is not None
            number("<I", item_type, f"item type of {what}")
            number("<Q", len(item), f"item count of {what}")
            for element in item:
                if item_type == V.ARRAY:
                    value(V.ARRAY, element[1], f"item of {what}", element[0])
                else:
                    value(item_type, element, f"item of {what}", None)
        else:
            fmt = _SCALAR_FORMATS[V(value_type)]
            if fmt[-1] in "fd":
                number(fmt, float(item), what)
            else:
                number(fmt, int(item), what)

    number("<I", parts.version, "version")
    number("<Q", len(parts.tensors), "tensor_count")
    number("<Q", len(parts.key_values), "kv_count")
    for kv in parts.key_values:
        name = _text(kv.name)
        string(kv.name, f"key {name}")
        number("<I", kv.value_type, f"type of {name}")
        value(kv.value_type, kv.value, name, kv.item_type)
    offset = 0
    for tensor in parts.tensors:
        name = _text(tensor.name)
        string(tensor.name, f"tensor name {name}")
        number("<I", len(tensor.shape), f"dims of {name}")
        for dim in tensor.shape:
            number("<Q", dim, f"shape of {name}")
        number("<I", tensor.tensor_type, f"type of {name}")
        number("<Q", offset if tensor.offset is None else tensor.offset, f"offset of {name}")
        offset += _padded(len(tensor.data), parts.alignment)
    out.extend(bytes(_padded(len(out), parts.alignment) - len(out)))
    for tensor in parts.tensors:
        out.extend(tensor.data)
        out.extend(bytes(_padded(len(tensor.data), parts.alignment) - len(tensor.data)))
    parts.slots = slots
    return bytes(out)


def _text(name: str | bytes) -> str:
    return name if isinstance(name, str) else name.decode("utf-8", "replace")


def _padded(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment

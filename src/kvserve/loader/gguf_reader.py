"""A strict GGUF reader: every length, count, type and offset is checked against the file.

A GGUF file is a header (magic, version, counts, metadata key/values, a table
of tensors) followed by aligned tensor data. Every length in the header is a
64-bit number the file chooses, so a reader that trusts them can be made to
loop for ever, allocate without bound or read past the end. Here each one is
checked before it is used:

- a string or array must fit in the bytes left after it; an array holds at
  most :data:`MAX_ARRAY_ITEMS` items (a vocabulary and its merges stay far
  below); arrays of arrays are refused (llama.cpp refuses them too);
- value and tensor types must be known ones;
- a tensor has 1 to 4 positive dimensions (ggml's limit), its rows are whole
  quantization blocks, and its data lies inside the file, where llama.cpp
  expects it: each tensor right after the previous one, padded to the
  alignment, which is a power of two;
- keys (non-empty) and tensor names are UTF-8 and unique; the file is
  little-endian.

Memory stays proportional to the header: scalar arrays and tensor data are
read-only views of the memory-mapped file, strings are ``bytes`` (decoded
only when asked for). Every failure is a :class:`ModelLoadError` whose
``field`` names the header part, metadata key or tensor at fault.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_types import GGUFField, GGUFFile, GGUFTensor

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# The largest array a file may hold. The biggest real ones are per-token lists
# (262,144 tokens for Gemma 3, 280,147 merges for Llama 3); the bound matches
# ArchConfig's largest vocabulary.
MAX_ARRAY_ITEMS = 1 << 22
# The GGUF specification's limit on a key's length.
MAX_KEY_BYTES = 65535
# ggml tensors have at most 4 dimensions.
MAX_TENSOR_DIMS = 4

# Little-endian numpy dtype of each scalar value type (bools are stored as one byte).
_SCALAR_DTYPES: dict[GGUFValueType, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

# The fewest bytes a metadata entry (8-byte key length, a 1-byte key, type,
# a 1-byte value) and a tensor entry (name length, an empty name, one
# dimension, type, offset) can take: counts beyond bytes left / these are lies.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


def read_gguf(path: Path) -> GGUFFile:
    """Parse ``path``'s header and map its tensors; raises ModelLoadError on anything wrong."""
    try:
        with path.open("rb") as file:
            if path.stat().st_size == 0:
                raise ModelLoadError(f"{path} is empty, not a GGUF file", field="magic")
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return _Parser(path, buffer).parse()


class _Parser:
    """Reads the header front to back; ``offset`` is the next unread byte."""

    def __init__(self, path: Path, buffer: mmap.mmap) -> None:
        self.path = path
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = 0

    def parse(self) -> GGUFFile:
        if self.buffer[:4] != GGUF_MAGIC:
            raise self.error("does not start with the GGUF magic bytes", "magic")
        self.need(8, "version")
        version_bytes = self.buffer[4:8]
        self.offset = 8
        version = int.from_bytes(version_bytes, "little")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version_bytes, "big") in SUPPORTED_VERSIONS:
                raise self.error("is a big-endian GGUF file; only little-endian is read", "version")
            raise self.error(f"has GGUF version {version}; supported: 2, 3", "version")
        tensor_count = self.unpack("<Q", "tensor_count")
        kv_count = self.unpack("<Q", "kv_count")
        self.check_count(kv_count, _MIN_KV_BYTES, "kv_count")
        fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            field = self.read_field()
            if field.name in fields:
                raise self.error(f"has metadata key {field.name!r} twice", field.name)
            fields[field.name] = field
        self.check_count(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor_count")
        infos = [self.read_tensor_info() for _ in range(tensor_count)]
        alignment = _alignment(fields, self)
        data_start = -(-self.offset // alignment) * alignment
        return GGUFFile(
            path=self.path,
            version=version,
            alignment=alignment,
            data_start=data_start,
            fields=fields,
            tensors=self.map_tensors(infos, data_start, alignment),
        )

    # ------------------------------------------------------------ primitives

    def error(self, message: str, field: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} {message}", field=field)

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.size - self.offset:
            raise self.error(
                f"is truncated or corrupt: {what} needs {num_bytes} bytes at offset "
                f"{self.offset}, the file has {self.size - self.offset} left",
                what,
            )

    def unpack(self, fmt: str, what: str) -> Any:
        num_bytes = struct.calcsize(fmt)
        self.need(num_bytes, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += num_bytes
        return value

    def check_count(self, count: int, min_item_bytes: int, what: str) -> None:
        # Checked up front so a lying count fails at once, not after a long loop.
        if count * min_item_bytes > self.size - self.offset:
            raise self.error(
                f"claims {what} {count}, more than the {self.size - self.offset} bytes "
                "left can hold",
                what,
            )

    def read_bytes(self, what: str) -> bytes:
        length = self.unpack("<Q", what)
        self.need(length, what)
        data = self.buffer[self.offset : self.offset + length]
        self.offset += length
        return data

    def read_name(self, what: str, max_bytes: int | None = None) -> str:
        raw = self.read_bytes(what)
        if max_bytes is not None and len(raw) > max_bytes:
            raise self.error(f"has a {what} of {len(raw)} bytes (at most {max_bytes})", what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"has a {what} that is not UTF-8: {exc}", what) from exc

    def value_type(self, key: str) -> GGUFValueType:
        raw_type = self.unpack("<I", key)
        try:
            return GGUFValueType(raw_type)
        except ValueError:
            raise self.error(
                f"has metadata {key!r} of unknown value type {raw_type}", key
            ) from None

    # ------------------------------------------------------------ metadata

    def read_field(self) -> GGUFField:
        key = self.read_name("metadata key", MAX_KEY_BYTES)
        if not key:
            raise self.error("has an empty metadata key", "metadata key")
        value_type = self.value_type(key)
        if value_type == GGUFValueType.STRING:
            return GGUFField(key, value_type, None, self.read_bytes(key))
        if value_type != GGUFValueType.ARRAY:
            return GGUFField(key, value_type, None, self.read_scalar(value_type, key))
        item_type = self.value_type(key)
        count = self.unpack("<Q", key)
        if count > MAX_ARRAY_ITEMS:
            raise self.error(
                f"has metadata {key!r}, an array of {count} items (at most {MAX_ARRAY_ITEMS})", key
            )
        if item_type == GGUFValueType.ARRAY:
            raise self.error(f"has metadata {key!r}, an array of arrays (not supported)", key)
        if item_type == GGUFValueType.STRING:
            self.check_count(count, 8, key)
            return GGUFField(
                key, value_type, item_type, [self.read_bytes(key) for _ in range(count)]
            )
        dtype = _SCALAR_DTYPES[item_type]
        self.need(count * dtype.itemsize, key)
        items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
        self.offset += count * dtype.itemsize
        return GGUFField(key, value_type, item_type, items)

    def read_scalar(self, value_type: GGUFValueType, key: str) -> int | float | bool:
        dtype = _SCALAR_DTYPES[value_type]
        self.need(dtype.itemsize, key)
        value = np.frombuffer(self.buffer, dtype=dtype, count=1, offset=self.offset)[0].item()
        self.offset += dtype.itemsize
        return bool(value) if value_type == GGUFValueType.BOOL else value

    # ------------------------------------------------------------ tensors

    def read_tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.read_name("tensor name")
        num_dims = self.unpack("<I", name)
        if not 1 <= num_dims <= MAX_TENSOR_DIMS:
            raise self.error(
                f"has tensor {name!r} with {num_dims} dimensions (1 to {MAX_TENSOR_DIMS})", name
            )
        shape = tuple(self.unpack("<Q", name) for _ in range(num_dims))
        if min(shape) < 1:
            raise self.error(
                f"has tensor {name!r} of shape {list(shape)}, with an empty dimension", name
            )
        raw_type = self.unpack("<I", name)
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.error(f"has tensor {name!r} of unknown type {raw_type}", name) from None
        if tensor_type not in GGML_QUANT_SIZES:
            raise self.error(
                f"has tensor {name!r} of type {tensor_type.name}, which has no size", name
            )
        return name, shape, tensor_type, self.unpack("<Q", name)

    def map_tensors(
        self,
        infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]],
        data_start: int,
        alignment: int,
    ) -> list[GGUFTensor]:
        tensors: list[GGUFTensor] = []
        names: set[str] = set()
        expected_offset = 0
        for name, shape, tensor_type, offset in infos:
            if name in names:
                raise self.error(f"has tensor {name!r} twice", name)
            names.add(name)
            block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
            if shape[0] % block_size != 0:
                raise self.error(
                    f"has tensor {name!r} with rows of {shape[0]} values, not whole "
                    f"{tensor_type.name} blocks of {block_size}",
                    name,
                )
            row_bytes = shape[0] // block_size * block_bytes
            num_rows = 1
            for dim in shape[1:]:
                num_rows *= dim
            n_bytes = row_bytes * num_rows
            if offset != expected_offset:
                raise self.error(
                    f"has tensor {name!r} at data offset {offset}; the previous tensors end "
                    f"at {expected_offset} (tensors must follow each other, aligned)",
                    name,
                )
            absolute = data_start + offset
            if absolute + n_bytes > self.size:
                raise self.error(
                    f"is truncated: tensor {name!r} needs bytes {absolute} to "
                    f"{absolute + n_bytes}, the file has {self.size}",
                    name,
                )
            expected_offset += -(-n_bytes // alignment) * alignment
            data = np.frombuffer(self.buffer, dtype=np.uint8, count=n_bytes, offset=absolute)
            array_shape = tuple(reversed(shape))
            tensors.append(
                GGUFTensor(
                    name=name,
                    tensor_type=tensor_type,
                    shape=shape,
                    data_offset=absolute,
                    n_bytes=n_bytes,
                    data=data.reshape(*array_shape[:-1], row_bytes),
                )
            )
        return tensors


def _alignment(fields: dict[str, GGUFField], parser: _Parser) -> int:
    field = fields.get(ALIGNMENT_KEY)
    if field is None:
        return DEFAULT_ALIGNMENT
    alignment = field.raw
    if field.value_type != GGUFValueType.UINT32 or alignment < 1 or alignment & (alignment - 1):
        raise parser.error(
            f"has {ALIGNMENT_KEY} {alignment!r} ({field.value_type.name}); it must be a "
            "UINT32 power of two",
            ALIGNMENT_KEY,
        )
    return int(alignment)

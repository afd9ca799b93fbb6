"""kvserve's GGUF reader: the same content as gguf-py on honest files, ModelLoadError on hostile ones."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_bytes import GGUFParts, KeyValue, TensorPart, parts_of, serialize
from gguf_fixtures import TinySpec, write_gguf
from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_reader import MAX_ARRAY_ITEMS, read_gguf

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, TinySpec(arch="qwen2", tied=False))
    return path


@pytest.fixture
def parts(tiny_gguf: Path) -> GGUFParts:
    return parts_of(tiny_gguf)


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    return path


def load_error(tmp_path: Path, data: bytes) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as excinfo:
        read_gguf(write(tmp_path, data))
    return excinfo.value


def test_reads_what_gguf_py_reads(tiny_gguf: Path) -> None:
    ours, theirs = read_gguf(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    their_fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(their_fields)
    for key, field in ours.fields.items():
        assert field.contents() == their_fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert list(mine.shape) == reference.shape.tolist()
        assert mine.data_offset == reference.data_offset
        assert mine.data.tobytes() == reference.data.tobytes(), mine.name
        np.testing.assert_array_equal(
            gguf.quants.dequantize(mine.data, mine.tensor_type),
            gguf.quants.dequantize(reference.data, reference.tensor_type),
        )


def test_serialized_parts_round_trip(parts: GGUFParts, tmp_path: Path) -> None:
    # Guards the tests below: the crafted files differ from an honest one only where they say.
    reread = read_gguf(write(tmp_path, serialize(parts)))
    assert [t.name for t in reread.tensors] == [t.name for t in parts.tensors]
    assert reread.fields["qwen2.block_count"].contents() == 2


def test_every_truncation_is_a_model_load_error(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    # Every cut inside the header, then a spread of cuts through the tensor data.
    cuts = [*range(0, read_gguf(tiny_gguf).data_start + 1), *range(0, len(data) - 1, 997)]
    for cut in cuts:
        with pytest.raises(ModelLoadError):
            read_gguf(write(tmp_path, data[:cut]))


def patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def slot_offset(parts: GGUFParts, what: str) -> int:
    return next(slot.offset for slot in parts.slots if slot.what == what)


@pytest.mark.parametrize(
    ("what", "value", "field"),
    [
        ("kv_count", 2**60, "kv_count"),
        ("tensor_count", 2**40, "tensor_count"),
        ("length of key general.architecture", 2**63, "metadata key"),
        ("length of general.architecture", 2**64 - 1, "general.architecture"),
        ("item count of tokenizer.ggml.tokens", MAX_ARRAY_ITEMS + 1, "tokenizer.ggml.tokens"),
        ("item count of tokenizer.ggml.tokens", 2**33, "tokenizer.ggml.tokens"),
        ("type of qwen2.block_count", 99, "qwen2.block_count"),
        ("dims of token_embd.weight", 0, "token_embd.weight"),
        ("dims of token_embd.weight", 5, "token_embd.weight"),
        ("shape of token_embd.weight", 0, "token_embd.weight"),
        ("shape of token_embd.weight", 2**62, "token_embd.weight"),
        ("type of token_embd.weight", 1000, "token_embd.weight"),
        ("offset of output_norm.weight", 2**63, "output_norm.weight"),
        ("offset of output_norm.weight", 8, "output_norm.weight"),
    ],
)
def test_a_lying_number_is_refused_naming_its_field(
    parts: GGUFParts, tmp_path: Path, what: str, value: int, field: str
) -> None:
    data = serialize(parts)
    offset = slot_offset(parts, what)
    size = next(slot.size for slot in parts.slots if slot.what == what)
    error = load_error(tmp_path, patch(data, offset, "<Q" if size == 8 else "<I", value))
    assert error.field == field
    assert error.param == "model"


def test_an_array_of_scalars_longer_than_the_file_is_refused(
    parts: GGUFParts, tmp_path: Path
) -> None:
    # A scalar array is read as one view: its length is checked against the bytes left.
    crafted = parts.with_value("general.numbers", V.ARRAY, [1, 2, 3], V.UINT32)
    data = serialize(crafted)
    offset = slot_offset(crafted, "item count of general.numbers")
    assert load_error(tmp_path, patch(data, offset, "<Q", 10**6)).field == "general.numbers"


def test_an_array_of_arrays_is_refused(parts: GGUFParts, tmp_path: Path) -> None:
    crafted = parts.with_value("general.nested", V.ARRAY, [(V.UINT32, [7])], V.ARRAY)
    assert load_error(tmp_path, serialize(crafted)).field == "general.nested"


@pytest.mark.parametrize(
    ("key_value", "field"),
    [
        (KeyValue("general.alignment", V.UINT32, 24), "general.alignment"),
        (KeyValue("general.alignment", V.UINT32, 0), "general.alignment"),
        (KeyValue("general.alignment", V.UINT64, 32), "general.alignment"),
        (KeyValue("general.name", V.STRING, b"x"), "general.name"),  # a duplicate key
    ],
)
def test_bad_alignment_and_duplicate_keys_are_refused(
    parts: GGUFParts, tmp_path: Path, key_value: KeyValue, field: str
) -> None:
    crafted = replace(parts, key_values=[*parts.key_values, key_value])
    if key_value.name == "general.name":
        crafted = replace(crafted, key_values=[*crafted.key_values, key_value])
    assert load_error(tmp_path, serialize(crafted)).field == field


def test_duplicate_tensor_and_bad_utf8_names_are_refused(parts: GGUFParts, tmp_path: Path) -> None:
    first = parts.tensors[0]
    doubled = replace(parts, tensors=[*parts.tensors, first])
    assert load_error(tmp_path, serialize(doubled)).field == first.name
    renamed = replace(parts, tensors=[replace(first, name=b"\xff\xfe"), *parts.tensors[1:]])
    assert load_error(tmp_path, serialize(renamed)).field == "tensor name"
    for key in (b"\xc3", b""):
        bad_key = replace(parts, key_values=[KeyValue(key, V.UINT8, 1), *parts.key_values])
        assert load_error(tmp_path, serialize(bad_key)).field == "metadata key"


def test_rows_that_are_not_whole_blocks_are_refused(parts: GGUFParts, tmp_path: Path) -> None:
    # A Q8_0 tensor of 40 values per row: blocks are 32 values.
    tensor = TensorPart("blk.0.attn_q.weight", (40, 1), Q.Q8_0, bytes(34 * 2))
    assert load_error(tmp_path, serialize(replace(parts, tensors=[tensor]))).field == (
        "blk.0.attn_q.weight"
    )


def test_header_errors_name_the_file_part(tmp_path: Path) -> None:
    assert load_error(tmp_path, b"").field == "magic"
    assert load_error(tmp_path, b"GGML" + bytes(20)).field == "magic"
    assert load_error(tmp_path, b"GGUF" + struct.pack("<I", 1) + bytes(16)).field == "version"
    big_endian = b"GGUF" + struct.pack(">I", 3) + bytes(16)
    error = load_error(tmp_path, big_endian)
    assert (error.field, "big-endian" in str(error)) == ("version", True)


def test_non_utf8_strings_fail_when_read_not_when_parsed(parts: GGUFParts, tmp_path: Path) -> None:
    crafted = parts.with_value("general.name", V.STRING, b"\xff\xfe")
    parsed = read_gguf(write(tmp_path, serialize(crafted)))
    with pytest.raises(UnicodeDecodeError):
        parsed.fields["general.name"].contents()

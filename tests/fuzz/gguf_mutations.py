"""Mutations of a GGUF file: byte damage, lying header numbers, rewritten metadata and tensors.

Byte damage (truncation, bit flips, overwritten runs) tests the reader's
bounds checks; the structured mutations go through
:mod:`gguf_bytes` and produce files that parse but say absurd things
(a head count of 0, a vocabulary of 2^40, a string where a number belongs,
a tensor of the wrong shape or type), which is what the config derivation
and the weight loading must refuse.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import gguf
import numpy as np

from gguf_bytes import GGUFParts, Slot, TensorPart, serialize

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

# Numbers that break code which trusts them: zero, off-by-ones at powers of two, the extremes.
INTERESTING_UINTS = sorted(
    {0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 255, 256, 4095, 4096, 65535, 65536}
    | {(1 << bits) + delta for bits in (22, 24, 31, 32, 40, 62, 63, 64) for delta in (-1, 0)}
)
INTERESTING_FLOATS = [0.0, -0.0, -1.0, 1e-45, 1e-8, 0.5, 1.0, 2.0, 1e38, float("inf"), float("nan")]
_INTEGER_BITS = {
    V.UINT8: 8,
    V.INT8: 8,
    V.BOOL: 8,
    V.UINT16: 16,
    V.INT16: 16,
    V.UINT32: 32,
    V.INT32: 32,
    V.UINT64: 64,
    V.INT64: 64,
}
INTERESTING_STRINGS: list[bytes] = [
    b"",
    b"4",
    b"llama",
    b"none",
    b"linear",
    b"\xff\xfe",
    b"x" * 300,
]

# The keys the loader reads; mutations favour them over the rest.
_ARCH_KEYS = [
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_beta_fast",
]
_GLOBAL_KEYS = [
    "general.architecture",
    "general.alignment",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
]


def interesting_uint(rng: random.Random, original: int = 0, max_value: int = (1 << 64) - 1) -> int:
    """A number likely to break a check: a boundary value or a near miss of ``original``."""
    candidates = [*INTERESTING_UINTS, original + 1, original - 1, original * 2, original // 2]
    return min(max(rng.choice(candidates), 0), max_value)


def random_value(rng: random.Random) -> tuple[int, Any, int | None]:
    """``(value_type, value, item_type)`` of any GGUF type, with an awkward value."""
    value_type = rng.choice(list(V))
    if value_type == V.STRING:
        return value_type, rng.choice(INTERESTING_STRINGS), None
    if value_type == V.ARRAY:
        item_type = rng.choice([t for t in V if t != V.ARRAY])
        count = rng.choice([0, 1, 2, 3, 30, 1000])
        items = [random_scalar(rng, item_type) for _ in range(count)]
        return value_type, items, item_type
    return value_type, random_scalar(rng, value_type), None


def random_scalar(rng: random.Random, value_type: int) -> Any:
    if value_type == V.STRING:
        return rng.choice(INTERESTING_STRINGS)
    if value_type in (V.FLOAT32, V.FLOAT64):
        return rng.choice(INTERESTING_FLOATS)
    bits = _INTEGER_BITS[V(value_type)]
    signed = value_type in (V.INT8, V.INT16, V.INT32, V.INT64)
    value = interesting_uint(rng, max_value=(1 << bits) - 1)
    if signed:
        value = rng.choice([value >> 1, -(value >> 1) - 1, -1])
    return value


def _arch_of(parts: GGUFParts) -> str:
    for kv in parts.key_values:
        if kv.name == "general.architecture" and isinstance(kv.value, bytes):
            return kv.value.decode("utf-8", "replace")
    return "llama"


def rewrite_metadata(rng: random.Random, parts: GGUFParts) -> tuple[str, GGUFParts]:
    """Replace (or add, or drop) one key the loader reads, with a value of any type."""
    key = rng.choice([f"{_arch_of(parts)}.{k}" for k in _ARCH_KEYS] + _GLOBAL_KEYS)
    if rng.random() < 0.2:
        return f"drop {key}", parts.without(key)
    existing = next((kv for kv in parts.key_values if kv.name == key), None)
    if existing is not None and existing.value_type != V.ARRAY and rng.random() < 0.5:
        # Same type, awkward value: what a bit-exact but hostile writer produces.
        value = random_scalar(rng, existing.value_type)
        return f"set {key}", parts.with_value(key, existing.value_type, value)
    value_type, value, item_type = random_value(rng)
    return f"retype {key}", parts.with_value(key, value_type, value, item_type)


def rewrite_tensor(rng: random.Random, parts: GGUFParts) -> tuple[str, GGUFParts]:
    """Change one tensor's shape, type, name, offset or data, or drop or double it."""
    index = rng.randrange(len(parts.tensors))
    tensor = parts.tensors[index]
    tensors = list(parts.tensors)
    action = rng.choice(["shape", "type", "name", "offset", "data", "drop", "double"])
    if action == "shape":
        shape = list(tensor.shape)
        if rng.random() < 0.3:
            shape = shape[::-1] if len(shape) > 1 else [*shape, 1]
        else:
            dim = rng.randrange(len(shape))
            shape[dim] = interesting_uint(rng, shape[dim])
        tensors[index] = replace(tensor, shape=tuple(shape))
    elif action == "type":
        tensors[index] = replace(tensor, tensor_type=rng.choice([*list(Q), 99, 2**32 - 1]))
    elif action == "name":
        names = [t.name for t in parts.tensors]
        new_name = rng.choice([*names, "blk.999.attn_q.weight", "blk.0.attn_q.bias", "x", ""])
        tensors[index] = replace(tensor, name=new_name)
    elif action == "offset":
        tensors[index] = replace(tensor, offset=interesting_uint(rng, 0))
    elif action == "data":
        tensors[index] = replace(tensor, data=tensor.data[: rng.randrange(len(tensor.data) + 1)])
    elif action == "drop":
        del tensors[index]
    else:
        tensors.insert(rng.randrange(len(tensors) + 1), tensor)
    return f"tensor {action}", replace(parts, tensors=tensors, slots=[])


def add_rope_freqs(rng: random.Random, parts: GGUFParts) -> tuple[str, GGUFParts]:
    """Add (or replace) a rope_freqs tensor of awkward values and length."""
    count = rng.choice([1, 8, 16, 32])
    values = np.array([rng.choice(INTERESTING_FLOATS) for _ in range(count)], dtype=np.float32)
    tensor = TensorPart("rope_freqs.weight", (count,), Q.F32, values.tobytes())
    others = [t for t in parts.tensors if t.name != "rope_freqs.weight"]
    return "rope_freqs", replace(parts, tensors=[*others, tensor], slots=[])


STRUCTURED: list[Callable[[random.Random, GGUFParts], tuple[str, GGUFParts]]] = [
    rewrite_metadata,
    rewrite_metadata,
    rewrite_tensor,
    add_rope_freqs,
]


def lie_in_slot(rng: random.Random, data: bytes, slots: list[Slot]) -> tuple[str, bytes]:
    """Overwrite one number of the header (a count, length, type or offset) with a boundary value."""
    slot = rng.choice(slots)
    original = int.from_bytes(data[slot.offset : slot.offset + slot.size], "little")
    value = interesting_uint(rng, original, (1 << (8 * slot.size)) - 1)
    patched = (
        data[: slot.offset] + value.to_bytes(slot.size, "little") + data[slot.offset + slot.size :]
    )
    return f"lie {slot.what.split(' of ')[0]}", patched


def damage_bytes(rng: random.Random, data: bytes, header_end: int) -> tuple[str, bytes]:
    """Truncate, flip bits or overwrite a run, mostly inside the header."""

    def position() -> int:
        limit = header_end if rng.random() < 0.7 else len(data)
        return rng.randrange(max(limit, 1))

    action = rng.choice(["truncate", "flip", "overwrite"])
    if action == "truncate":
        return "truncate", data[: position()]
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        at = position()
        if action == "flip":
            buffer[at] ^= 1 << rng.randrange(8)
        else:
            run = bytes(rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)]) for _ in range(8))
            buffer[at : at + 8] = run[: len(buffer) - at]
    return action, bytes(buffer)


def mutate_gguf(rng: random.Random, parts: GGUFParts) -> tuple[str, bytes]:
    """One fuzz case from a base file's parts: a description and the file's bytes."""
    steps = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        step, parts = rng.choice(STRUCTURED)(rng, parts)
        steps.append(step)
    data = serialize(parts)
    header_end = parts.slots[-1].offset + parts.slots[-1].size if parts.slots else len(data)
    if not steps or rng.random() < 0.35:
        if rng.random() < 0.5:
            step, data = lie_in_slot(rng, data, parts.slots)
        else:
            step, data = damage_bytes(rng, data, header_end)
        steps.append(step)
    return " + ".join(steps), data

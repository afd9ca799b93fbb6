"""Mutations of a Hugging Face folder: config.json, safetensors headers and bytes, the shard index.

A case copies the base folder and damages one or two things: a config value
(any JSON type, boundary numbers, deep nesting), the tokenizer files, a safetensors header entry
(dtype, shape, data offsets, the header length), the file's bytes, or the
shard index (names that leave the folder, absolute paths, symlinks out, a
FIFO, non-strings).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz.gguf_mutations import INTERESTING_FLOATS, interesting_uint

_CONFIG_KEYS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "sliding_window",
    "tie_word_embeddings",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
]
_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "I32", "I64", "U8", "BOOL", "F8_E4M3", "C64", "X"]
_INDEX = "model.safetensors.index.json"


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type, favouring boundary numbers."""
    kind = rng.choice(["int", "int", "negative", "float", "string", "null", "bool", "list", "dict"])
    if kind == "int":
        return interesting_uint(rng)
    if kind == "negative":
        return -interesting_uint(rng) - 1
    if kind == "float":
        return rng.choice(INTERESTING_FLOATS)
    if kind == "string":
        return rng.choice(["", "4", "llama", "linear", "llama3", "é"])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if depth > 2:
        return []
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["rope_type", "factor", "low_freq_factor", "high_freq_factor", "type", "rope_theta"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutate_config(rng: random.Random, folder: Path) -> str:
    path = folder / "config.json"
    roll = rng.random()
    if roll < 0.1:
        path.write_bytes(rng.choice([b"", b"{", b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000]))
        return "config garbage"
    config = json.loads(path.read_text())
    key = rng.choice(_CONFIG_KEYS)
    if roll < 0.25:
        config.pop(key, None)
        return f"config drop {key}"
    config[key] = random_json(rng)
    path.write_text(json.dumps(config))
    return f"config set {key}"


def _plain_weight_files(folder: Path) -> list[Path]:
    # An earlier step may have made a shard a FIFO or a link to /dev/zero:
    # reading those would block the fuzzer itself.
    files = [p for p in sorted(folder.glob("*.safetensors")) if p.is_file() and not p.is_symlink()]
    if not files:
        raise ValueError("no plain safetensors file left to damage")
    return files


def _read_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + header_len]), data[8 + header_len :]


def _write_safetensors(path: Path, header: dict[str, Any], body: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


def mutate_safetensors_header(rng: random.Random, folder: Path) -> str:
    path = rng.choice(_plain_weight_files(folder))
    header, body = _read_safetensors(path)
    names = [name for name in header if name != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    action = rng.choice(["dtype", "shape", "offsets", "drop", "rename", "metadata"])
    if action == "dtype":
        entry["dtype"] = rng.choice(_DTYPES)
    elif action == "shape":
        shape = entry["shape"]
        if shape and rng.random() < 0.7:
            shape[rng.randrange(len(shape))] = interesting_uint(rng, shape[0], 2**63)
        else:
            entry["shape"] = rng.choice([[], [1], shape[::-1], [*shape, 1]])
    elif action == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(
            [
                [end, start],
                [start, interesting_uint(rng, end, 2**63)],
                [0, end - start],
                [start, start],
            ]
        )
    elif action == "drop":
        del header[name]
    elif action == "rename":
        header[rng.choice(names)] = header.pop(name)
    else:
        header["__metadata__"] = random_json(rng)
    _write_safetensors(path, header, body)
    return f"safetensors {action}"


def damage_safetensors_bytes(rng: random.Random, folder: Path) -> str:
    path = rng.choice(_plain_weight_files(folder))
    data = bytearray(path.read_bytes())
    action = rng.choice(["truncate", "flip", "header length"])
    if action == "truncate":
        del data[rng.randrange(len(data)) :]
    elif action == "flip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(min(len(data), 4096))
            data[at] ^= 1 << rng.randrange(8)
    else:
        (original,) = struct.unpack_from("<Q", data)
        data[:8] = struct.pack("<Q", interesting_uint(rng, original))
    path.write_bytes(bytes(data))
    return f"safetensors bytes {action}"


def mutate_index(rng: random.Random, folder: Path) -> str:
    """Point shard names somewhere they must not go (or break the index's shape)."""
    index_path = folder / _INDEX
    if not index_path.exists():
        return mutate_safetensors_header(rng, folder)
    index = json.loads(index_path.read_text())
    weight_map: dict[str, Any] = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    victim = rng.choice(shards)
    outside = folder.parent / "outside.safetensors"
    if folder / victim not in _plain_weight_files(folder):
        raise ValueError(f"{victim} was already replaced by an earlier step")
    shutil.copyfile(folder / victim, outside)
    action = rng.choice(
        ["dotdot", "absolute", "symlink", "fifo", "missing", "type", "shape", "dir"]
    )
    target: Any = victim
    if action == "dotdot":
        target = f"../{outside.name}"
    elif action == "absolute":
        target = str(outside)
    elif action == "symlink":
        (folder / victim).unlink()
        (folder / victim).symlink_to(
            rng.choice([outside, Path("/dev/zero"), Path("/etc/hostname")])
        )
    elif action == "fifo":
        (folder / victim).unlink()
        os.mkfifo(folder / victim)
    elif action == "missing":
        target = "model-99999-of-99999.safetensors"
    elif action == "type":
        target = rng.choice([None, 3, [victim], {"a": victim}])
    elif action == "dir":
        target = rng.choice([".", "", "/", "config.json", _INDEX])
    else:
        index["weight_map"] = random_json(rng)
    if action not in ("shape", "symlink", "fifo"):
        index["weight_map"] = {k: target if v == victim else v for k, v in weight_map.items()}
    index_path.write_text(json.dumps(index))
    return f"index {action}"


def mutate_tokenizer_files(rng: random.Random, folder: Path) -> str:
    """Damage tokenizer.json or rewrite a value of tokenizer_config.json."""
    if rng.random() < 0.5:
        path = folder / "tokenizer.json"
        data = path.read_bytes()
        path.write_bytes(data[: rng.randrange(len(data))] if rng.random() < 0.5 else data[::-1])
        return "tokenizer.json damage"
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    key = rng.choice(
        [
            "tokenizer_class",
            "model_max_length",
            "bos_token",
            "eos_token",
            "chat_template",
            "added_tokens_decoder",
        ]
    )
    config[key] = random_json(rng)
    path.write_text(json.dumps(config))
    return f"tokenizer_config set {key}"


HF_MUTATIONS: list[Callable[[random.Random, Path], str]] = [
    mutate_tokenizer_files,
    mutate_config,
    mutate_config,
    mutate_safetensors_header,
    mutate_safetensors_header,
    damage_safetensors_bytes,
    mutate_index,
]


def mutate_hf(rng: random.Random, base: Path, folder: Path) -> str:
    """Copy ``base`` to ``folder`` and damage it; returns a description."""
    shutil.copytree(base, folder)
    steps = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        try:
            steps.append(rng.choice(HF_MUTATIONS)(rng, folder))
        except (
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RecursionError,
            struct.error,
        ):
            # A second step may meet what the first one broke (a header that no
            # longer parses); the case then carries the first step's damage only.
            steps.append("skipped")
    return " + ".join(steps)

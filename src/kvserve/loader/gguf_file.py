"""Open a GGUF file and read its metadata, turning every failure into ModelLoadError.

Parsing is :mod:`kvserve.loader.gguf_reader`'s job: it checks the whole header
against the file before anything else reads it. The config, the weights and
the tokenizer each need the parsed file, so the last one is kept; it holds
the mmap of the file and the header's strings, not the tensor data.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_reader import read_gguf
from kvserve.loader.gguf_types import GGUFFile, GGUFTensor


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file at ``path`` (cached while the file is unchanged)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    # The file's size and mtime are part of the key so that a rewritten file is re-read.
    return _open_gguf_cached(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf_cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return read_gguf(path)


def field_value(reader: GGUFFile, key: str) -> Any:
    """The value of metadata ``key`` as a Python object (str, int, float, bool, list), or None."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"GGUF metadata {key!r} is not UTF-8: {exc}", field=key) from exc


def field_length(reader: GGUFFile, key: str) -> int | None:
    """The number of items of array metadata ``key`` (without decoding them), or None."""
    field = reader.fields.get(key)
    return None if field is None else len(field)


def tensor_names(reader: GGUFFile) -> set[str]:
    return {tensor.name for tensor in reader.tensors}


def find_tensor(reader: GGUFFile, name: str) -> GGUFTensor | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    return None

"""Open a GGUF file and read its metadata, turning every failure into ModelLoadError.

``gguf.GGUFReader`` memory-maps the file and parses the header (metadata and
tensor table) eagerly. On a bad file it raises whatever numpy raises
(ValueError, IndexError, ...); :func:`open_gguf` maps all of that to one clear
:class:`ModelLoadError`.

Parsing the header is not free (about 2 s for a 49k-token vocabulary, which is
stored as one metadata entry per token), and the config, the weights and the
tokenizer each need it, so the last reader is kept. It holds only the mmap of
the file, not its contents.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf

from kvserve.errors import ModelLoadError

# What GGUFReader raises on a truncated, corrupt or non-GGUF file: numpy
# reshape/view errors, index errors on short buffers, enum errors on unknown
# types, duplicate-name KeyErrors, and OS errors from mmap.
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A parsed reader for ``path`` (cached while the file is unchanged)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    # The file's size and mtime are part of the key so that a rewritten file is re-read.
    return _open_gguf_cached(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf_cached(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path, "r")
    except _READER_ERRORS as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated, corrupt or another format): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata ``key`` as a Python object (str, int, float, bool, list), or None."""
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"GGUF metadata {key!r} is unreadable: {exc}") from exc


def field_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """The number of elements of array metadata ``key`` (without decoding them), or None."""
    field = reader.get_field(key)
    return None if field is None else len(field.data)


def tensor_names(reader: gguf.GGUFReader) -> set[str]:
    return {tensor.name for tensor in reader.tensors}


def find_tensor(reader: gguf.GGUFReader, name: str) -> gguf.ReaderTensor | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    return None

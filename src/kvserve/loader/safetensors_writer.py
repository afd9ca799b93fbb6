"""Write a safetensors file one tensor at a time, never holding more than one in memory.

A safetensors file is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range; free-form string metadata under
``__metadata__``), then the tensors' bytes back to back. The header needs
every tensor's offsets, which are known only at the end, so tensor bytes go
to an anonymous scratch file as they arrive and :meth:`SafetensorsWriter.commit`
writes the header, appends the scratch bytes and renames the result into
place. The copy costs a moment once; holding a model's worth of converted
tensors in memory to call ``safetensors.torch.save_file`` could cost more
memory than the machine has.

Writing is best effort: any ``OSError`` (a full disk, say) turns the writer
off with a warning and leaves no file behind, since a cache that cannot be
written must never fail what it caches.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

from kvserve.private_cache import atomic_target

logger = logging.getLogger(__name__)

# torch dtype → safetensors dtype name, for the dtypes a checkpoint holds.
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

_COPY_CHUNK_BYTES = 1 << 22


class SafetensorsWriter:
    """Streams tensors into ``target``; a context manager that commits on success.

    Tensors are laid out in the order they are added. Use as::

        with SafetensorsWriter(path, {"key": "value"}) as writer:
            for name, tensor in tensors:
                writer.add(name, tensor)
        writer.committed  # True when ``path`` now holds them all
    """

    def __init__(self, target: Path, metadata: dict[str, str]) -> None:
        self.target = target
        self.metadata = metadata
        self.committed = False
        self._header: dict[str, Any] = {}
        self._num_bytes = 0
        self._scratch: IO[bytes] | None = None
        if sys.byteorder != "little":
            logger.warning("not caching %s: safetensors files are little-endian", target)
            return
        try:
            # Anonymous: it disappears with the process whatever happens.
            self._scratch = tempfile.TemporaryFile(dir=target.parent)  # noqa: SIM115 (closed by commit or discard)
        except OSError as exc:
            self._fail(exc)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device, any layout) under ``name``."""
        if self._scratch is None:
            return
        dtype = SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None or name in self._header:
            reason = "twice" if dtype is not None else f"in {tensor.dtype}, which it cannot store"
            self._fail(ValueError(f"tensor {name!r} was given {reason}"))
            return
        flat_bytes = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        try:
            self._scratch.write(flat_bytes.data)
        except OSError as exc:
            self._fail(exc)
            return
        begin, self._num_bytes = self._num_bytes, self._num_bytes + flat_bytes.nbytes
        self._header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [begin, self._num_bytes],
        }

    def commit(self) -> bool:
        """Write the file and rename it into place; True on success."""
        if self._scratch is None:
            return False
        header = json.dumps({"__metadata__": self.metadata, **self._header}).encode()
        # Pad with spaces (which the format allows) so the tensor bytes start 8-byte aligned.
        header += b" " * (-len(header) % 8)
        try:
            with atomic_target(self.target, suffix=".tmp") as tmp_path, tmp_path.open("wb") as out:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)
                self._scratch.seek(0)
                shutil.copyfileobj(self._scratch, out, _COPY_CHUNK_BYTES)
                out.flush()
                # On disk before the rename, so a crash cannot leave a full-size file of zeros.
                os.fsync(out.fileno())
        except OSError as exc:
            self._fail(exc)
            return False
        self._close_scratch()
        self.committed = True
        return True

    def discard(self) -> None:
        """Drop everything written so far; ``target`` is left as it was."""
        self._close_scratch()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def _fail(self, exc: Exception) -> None:
        logger.warning("not caching %s: %s", self.target, exc)
        self._close_scratch()

    def _close_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

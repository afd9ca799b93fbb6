"""What :mod:`kvserve.loader.gguf_reader` returns: a GGUF file's metadata and tensors.

Arrays of scalars and tensor data are read-only views of the memory-mapped
file; strings stay ``bytes`` until asked for, so a vocabulary is decoded only
by the code that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType


@dataclass(frozen=True)
class GGUFField:
    """One metadata key/value.

    raw: a scalar as a Python int, float or bool; a string as its ``bytes``;
    an array of scalars as a read-only numpy view of the file; an array of
    strings as a list of ``bytes``. ``item_type`` is set for arrays only.
    """

    name: str
    value_type: GGUFValueType
    item_type: GGUFValueType | None
    raw: Any

    def contents(self) -> Any:
        """The value as Python objects: str, int, float, bool or a list of them.

        Raises UnicodeDecodeError for a string that is not UTF-8.
        """
        if self.value_type == GGUFValueType.STRING:
            return self.raw.decode("utf-8")
        if self.value_type != GGUFValueType.ARRAY:
            return self.raw
        if self.item_type == GGUFValueType.STRING:
            return [item.decode("utf-8") for item in self.raw]
        if self.item_type == GGUFValueType.BOOL:
            return [bool(item) for item in self.raw]
        return self.raw.tolist()

    def __len__(self) -> int:
        """The number of items of an array (1 for anything else)."""
        return len(self.raw) if self.value_type == GGUFValueType.ARRAY else 1


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table and its data.

    shape: ggml order, fastest-varying first (``shape[0]`` elements per row).
    data: the stored bytes, a read-only view of the file shaped
        ``(*array_shape[:-1], bytes per row)``, as ``gguf.quants.dequantize`` takes it.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray

    @property
    def array_shape(self) -> tuple[int, ...]:
        """numpy/PyTorch order, slowest-varying first: ``(out_features, in_features)``."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file; its arrays and tensors are views of the mapped file."""

    path: Path
    version: int
    alignment: int
    data_start: int
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensor]

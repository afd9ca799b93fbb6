"""Weights for a model held in a given dtype, from the converted-weights cache when it has them.

The first load of a GGUF file dequantizes each tensor, converts it to the
model's dtype and, while handing it to the model, streams it into
``weights-<dtype>.safetensors`` in the file's cache entry (see
:mod:`kvserve.loader.model_cache`). Later loads memory-map that file and
hand over its tensors as they are: no dequantization, no conversion.

Converting before the copy changes nothing: the model is built with every
parameter in ``dtype``, and its ``load_weights`` would round a float32
tensor to ``dtype`` in ``copy_`` exactly as ``Tensor.to`` does here, so
cached and uncached loads give bit-identical parameters.

With ``--quantization q8_0|q4_0|q4_k`` the file is ``weights-<quantization>.safetensors``
instead: the quantized weights as uint8 rows of blocks, each one's GGUF type
in the file's metadata (``qtype:<name>``), the other tensors as the model
file holds them; a later load memory-maps it and quantizes nothing.

A cached file that is not trusted, does not parse (truncated, corrupt) or
describes another file, dtype or format is rebuilt with a warning.

A load that keeps the file's quantized tensors (``keep_quantized``) reads the
GGUF file itself and neither reads nor writes a weights file: its quantized
blocks are already the kernels' layout, mapped from the file, and a cached
file of dequantized copies would be the very memory they save. Only the
segments the kernels read in a layout of their own (Q4_K repacked on x86
with AVX2) are cached, by the kernels when they are bound: see
:mod:`kvserve.loader.repacked_cache` and :meth:`CachedWeights.repacked_cache`.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from safetensors import SafetensorError, safe_open

from kvserve.kernels.quant_weight import QUANT_TYPES, QuantizedTensor
from kvserve.loader.gguf_weights import iter_gguf_weights
from kvserve.loader.hf_folder import iter_safetensors_weights
from kvserve.loader.model_cache import (
    FORMAT_VERSION,
    ModelCacheEntry,
    dtype_name,
    model_cache_entry,
)
from kvserve.loader.quantize import QUANTIZE_AT_LOAD, CheckpointValue, quantize_weights
from kvserve.loader.repacked_cache import RepackedCache, repacked_cache
from kvserve.loader.safetensors_writer import SafetensorsWriter
from kvserve.loader.source import ModelSource
from kvserve.models.arch_config import ArchConfig
from kvserve.private_cache import untrusted_reason

logger = logging.getLogger(__name__)

# What safe_open and get_tensor raise on a bad file.
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


class WeightOrigin(enum.Enum):
    """Where the tensors of a load came from."""

    CACHE = "from the converted-weights cache"
    SOURCE_CACHED = "from the model file, now cached"
    SOURCE = "from the model file"


class CachedWeights:
    """``(hf_name, tensor)`` pairs for a model built in ``dtype``, for ``load_weights``.

    Iterate once; afterwards :attr:`origin` says where the tensors came from.
    GGUF sources go through the cache (unless it is off or unusable); Hugging
    Face folders yield their stored tensors, as :func:`iter_weights` does.

    quantization (``ModelConfig.quantization``): ``q8_0``, ``q4_0`` or ``q4_k``
    quantize the projection weights and token embeddings as they load (see
    :mod:`kvserve.loader.quantize`). A GGUF file's quantized weights are
    cached in ``weights-<quantization>.safetensors`` (whatever ``dtype``: the
    other tensors keep the file's float32), a Hugging Face folder's are
    quantized on every load.
    keep_quantized: a GGUF file's quantized matrices come as
    :class:`QuantizedTensor` views of the file, and no weights file is used
    (:meth:`repacked_cache` holds what the kernels repack).
    """

    def __init__(
        self,
        source: ModelSource,
        arch: ArchConfig,
        dtype: torch.dtype,
        quantization: str = "auto",
        keep_quantized: bool = False,
    ) -> None:
        self.source = source
        self.arch = arch
        self.dtype = dtype
        self.quantization = quantization
        self.keep_quantized = keep_quantized
        self.origin = WeightOrigin.SOURCE

    def repacked_cache(self) -> RepackedCache | None:
        """Where the kernels find this load's quantized segments in their own layout (and
        keep them), for a load that keeps a GGUF file's quantized tensors; else None."""
        if not self.keep_quantized or self.source.kind != "gguf":
            return None
        return repacked_cache(self.source)

    @property
    def _quantizing(self) -> bool:
        return self.quantization in QUANTIZE_AT_LOAD

    def __iter__(self) -> Iterator[tuple[str, CheckpointValue]]:
        if self.source.kind == "hf":
            weights = iter_safetensors_weights(self.source.path)
            if self._quantizing:
                yield from quantize_weights(weights, self.quantization, self.arch)
            else:
                yield from weights
            return
        if self.keep_quantized:
            yield from self._converted_from_source()
            return
        entry = model_cache_entry(self.source)
        if entry is None:
            yield from self._converted_from_source()
            return
        path = self._cache_path(entry)
        reason = untrusted_reason(path)
        if reason is None:
            try:
                # Everything that can be checked is checked before the first tensor leaves.
                with safe_open(str(path), framework="pt") as cached:
                    metadata = cached.metadata() or {}
                    names = self._check_cached(metadata, list(cached.keys()), entry)
                    for name in names:
                        yield name, _from_cache(name, cached.get_tensor(name), metadata)
                self.origin = WeightOrigin.CACHE
                return
            except _READ_ERRORS as exc:
                # Tensors already handed over are simply loaded again below.
                reason = f"it is unreadable ({type(exc).__name__}: {exc})"
        if os.path.lexists(path):
            logger.warning("rebuilding %s from the model file: %s", path, reason)
        yield from self._converted_and_cached(entry, path)

    def _cache_path(self, entry: ModelCacheEntry) -> Path:
        if self._quantizing:
            return entry.folder / f"weights-{self.quantization}.safetensors"
        return entry.weights_path(self.dtype)

    def _check_cached(
        self, metadata: dict[str, str], names: list[str], entry: ModelCacheEntry
    ) -> list[str]:
        """The tensor names of a cached file that was written for this source and dtype
        (or quantization)."""
        expected = self._metadata(entry)
        for key in expected:
            found = metadata.get(key)
            if found != expected[key]:
                raise ValueError(f"its {key} is {found!r}, expected {expected[key]!r}")
        if str(len(names)) != metadata.get("num_tensors"):
            raise ValueError(f"it holds {len(names)} tensors, its header says otherwise")
        return names

    def _metadata(self, entry: ModelCacheEntry) -> dict[str, str]:
        metadata = {"format": str(FORMAT_VERSION), "source_sha256": entry.source_sha256}
        if self._quantizing:
            metadata["quantization"] = self.quantization
        else:
            metadata["dtype"] = dtype_name(self.dtype)
        return metadata

    def _converted_from_source(self) -> Iterator[tuple[str, CheckpointValue]]:
        """The file's tensors in ``dtype``, quantized ones as stored (``keep_quantized``) or
        quantized to ``quantization`` (``q8_0``, ``q4_0``, ``q4_k``)."""
        weights: Iterator[tuple[str, CheckpointValue]] = iter_gguf_weights(
            self.source.path, self.arch, self.keep_quantized
        )
        if self._quantizing:
            yield from quantize_weights(weights, self.quantization, self.arch)
            return
        for name, tensor in weights:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            yield name, tensor

    def _converted_and_cached(
        self, entry: ModelCacheEntry, path: Path
    ) -> Iterator[tuple[str, CheckpointValue]]:
        names: list[str] = []
        writer = SafetensorsWriter(path, self._metadata(entry))
        with writer:
            for name, tensor in self._converted_from_source():
                if isinstance(tensor, QuantizedTensor):
                    # The blocks as uint8 rows; their type, which the bytes cannot tell, beside.
                    writer.add(name, tensor.data)
                    writer.metadata[_QTYPE_KEY + name] = tensor.qtype.name
                else:
                    writer.add(name, tensor)
                names.append(name)
                yield name, tensor
            writer.metadata["num_tensors"] = str(len(names))
        if writer.committed:
            self.origin = WeightOrigin.SOURCE_CACHED


# Metadata key prefix of a cached tensor held in quantized blocks: its GGUF type's name.
_QTYPE_KEY = "qtype:"


def _from_cache(name: str, tensor: torch.Tensor, metadata: dict[str, str]) -> CheckpointValue:
    """A cached tensor as it was handed over: uint8 rows of a quantized type become that
    QuantizedTensor again (ValueError, and a rebuild, if they do not fit the type)."""
    qtype_name = metadata.get(_QTYPE_KEY + name)
    if qtype_name is None:
        return tensor
    qtype = next((t for t in QUANT_TYPES if t.name == qtype_name), None)
    if qtype is None or tensor.dtype != torch.uint8 or tensor.dim() != 2:
        raise ValueError(f"tensor {name!r} is not {qtype_name} rows")
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, num_bytes = tensor.shape
    if num_bytes % block_bytes:
        raise ValueError(f"tensor {name!r} does not hold whole {qtype_name} blocks")
    return QuantizedTensor(qtype, rows, num_bytes // block_bytes * block_values, tensor)

"""Quantized segments in the kernels' repacked layout, kept in the model's cache entry.

A load that keeps a GGUF file's quantized tensors hands the kernels the
file's blocks; where the kernels read a type faster in another layout (Q4_K
on x86 with AVX2, see ``QuantOps.repack_layouts``), each segment of that type
is copied into it when the kernels are bound (``QuantOps.kernel_layout``).
That copy is private memory: two processes serving one file (replicas, a
restart while the old process drains) each hold their own, and a load
briefly needs the file's pages and the copy.

So the first load writes the repacked segments into the file's cache entry
(:mod:`kvserve.loader.model_cache`), and later loads memory-map them and
repack nothing: the pages are the page cache's, shared by every process that
maps the file, and the model file's pages of those segments are not read::

    weights-repacked-<kernel type ids>.safetensors

It holds only the repacked segments, uint8 ``[rows, row_bytes]`` named
``<weight's module name>#<segment index>``, each with its GGUF type
(``qtype:<name>``) and kernel type id (``kernel_type:<name>``) in the
metadata beside the entry's format and the source's SHA-256. The file name
carries the ids of the layouts this build repacks (``112`` for Q4_K), so a
build with other layouts (or more of them) keeps a file of its own, and a
build that repacks nothing (the portable kernels) never opens one.

What comes from the file is checked before the kernels take it: the header
must name this source, format and layouts, and each segment's shape and types
must be the ones asked for; then ``kernel_layout`` repacks a few rows of the
model file's segment and compares them with the stored rows, which catches a
changed repacking in the kernels or a changed row order in the model code (the
entry's key covers the loader, not those). A file that is not trusted, does
not parse or fails a check is replaced, with one warning, by a new one written
after the segments are repacked in memory; a segment it lacks is repacked and
the file rewritten with it. Writing is best effort (a full disk costs a
warning, never the load). The load that writes the file keeps its private
copies; the next start maps the file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError, safe_open

from kvserve.kernels.quant_ops import RepackedSegments
from kvserve.kernels.quant_weight import QuantSegment
from kvserve.loader.model_cache import FORMAT_VERSION, ModelCacheEntry, model_cache_entry
from kvserve.loader.safetensors_writer import SafetensorsWriter
from kvserve.loader.source import ModelSource
from kvserve.private_cache import untrusted_reason

logger = logging.getLogger(__name__)

# What safe_open and get_tensor raise on a bad file.
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)

_QTYPE_KEY = "qtype:"
_KERNEL_TYPE_KEY = "kernel_type:"


def repacked_cache(source: ModelSource) -> RepackedCache | None:
    """The repacked segments of ``source``'s cache entry; None where the cache is off or
    does not apply (Hugging Face folders, ``KVSERVE_WEIGHT_CACHE=0``, no usable folder)."""
    entry = model_cache_entry(source)
    return None if entry is None else RepackedCache(entry)


class RepackedCache:
    """The repacked-segments file of one cache entry, for the kernels of one build.

    :meth:`open` once with the layouts the kernels repack, hand :meth:`for_weight`
    to ``kernel_layout`` for each weight, then :meth:`finish` to write what was
    repacked in memory (nothing when every segment came from the file).
    """

    def __init__(self, entry: ModelCacheEntry) -> None:
        self.entry = entry
        self.path: Path | None = None
        self._layouts = ""
        self._stored: dict[str, torch.Tensor] = {}
        self._stored_metadata: dict[str, str] = {}
        # Every segment handed to the kernels, stored or repacked here, for a rewrite: its
        # GGUF type's name, kernel type id and repacked blocks (not the model file's
        # segment, which may be a copy the load made and the kernels no longer need).
        self._segments: dict[str, tuple[str, int, torch.Tensor]] = {}
        self._num_repacked = 0
        self._num_mapped = 0
        self._rejected: list[str] = []

    @property
    def num_mapped(self) -> int:
        """Segments the kernels took from the file."""
        return self._num_mapped

    @property
    def num_repacked(self) -> int:
        """Segments repacked in memory (absent from the file, or refused)."""
        return self._num_repacked

    def open(self, layouts: dict[GGMLQuantizationType, int]) -> None:
        """Map the file for these layouts (GGUF type → kernel type id), if it is usable."""
        ids = sorted(set(layouts.values()))
        self.path = self.entry.folder / f"weights-repacked-{'-'.join(map(str, ids))}.safetensors"
        self._layouts = ",".join(f"{q.name}={k}" for q, k in sorted(layouts.items()))
        reason = untrusted_reason(self.path)
        if reason is None:
            try:
                with safe_open(str(self.path), framework="pt") as stored:
                    metadata = stored.metadata() or {}
                    names = list(stored.keys())
                    self._check_header(metadata, len(names))
                    # Views of the mapped file: nothing is read until the kernels use it.
                    self._stored = {name: stored.get_tensor(name) for name in names}
                    self._stored_metadata = metadata
                return
            except _READ_ERRORS as exc:
                reason = f"it is unreadable ({type(exc).__name__}: {exc})"
        if os.path.lexists(self.path):
            self._rejected.append(reason)

    def _check_header(self, metadata: dict[str, str], num_tensors: int) -> None:
        for key, expected in self._header().items():
            if metadata.get(key) != expected:
                raise ValueError(f"its {key} is {metadata.get(key)!r}, expected {expected!r}")
        if metadata.get("num_tensors") != str(num_tensors):
            raise ValueError(f"it holds {num_tensors} tensors, its header says otherwise")

    def _header(self) -> dict[str, str]:
        return {
            "format": str(FORMAT_VERSION),
            "source_sha256": self.entry.source_sha256,
            "layouts": self._layouts,
        }

    def for_weight(self, name: str) -> RepackedSegments:
        """The segments of the weight of module ``name``, for ``QuantOps.kernel_layout``."""
        return _WeightSegments(self, name)

    def find(self, key: str, segment: QuantSegment, kernel_type: int) -> torch.Tensor | None:
        data = self._stored.get(key)
        if data is None:
            return None
        if (
            self._stored_metadata.get(_QTYPE_KEY + key) != segment.qtype.name
            or self._stored_metadata.get(_KERNEL_TYPE_KEY + key) != str(kernel_type)
            or data.dtype != torch.uint8
            or data.shape != segment.data.shape
        ):
            self.reject(key, f"it holds {key} as another type or shape")
            return None
        self._segments[key] = (segment.qtype.name, kernel_type, data)
        self._num_mapped += 1
        return data

    def keep(self, key: str, segment: QuantSegment, kernel_type: int, data: torch.Tensor) -> None:
        self._segments[key] = (segment.qtype.name, kernel_type, data)
        self._num_repacked += 1

    def reject(self, key: str, reason: str) -> None:
        self._rejected.append(f"segment {key}: {reason}")
        if self._segments.pop(key, None) is not None:
            self._num_mapped -= 1

    def finish(self) -> None:
        """Write every segment to a new file if any was repacked in memory; warn once
        about a file that was there but not used (whole or in part)."""
        if self._rejected and self.path is not None:
            logger.warning(
                "rebuilding %s from the model file: %s%s",
                self.path,
                self._rejected[0],
                f" (and {len(self._rejected) - 1} more)" if len(self._rejected) > 1 else "",
            )
        if not self._num_repacked or self.path is None:
            return
        writer = SafetensorsWriter(self.path, self._header())
        with writer:
            for key, (qtype_name, kernel_type, data) in self._segments.items():
                writer.add(key, data)
                writer.metadata[_QTYPE_KEY + key] = qtype_name
                writer.metadata[_KERNEL_TYPE_KEY + key] = str(kernel_type)
            writer.metadata["num_tensors"] = str(len(self._segments))
        if writer.committed:
            logger.info("cached %d repacked segments in %s", len(self._segments), self.path)


class _WeightSegments:
    """One weight's view of a :class:`RepackedCache`: its segments by index."""

    def __init__(self, cache: RepackedCache, name: str) -> None:
        self.cache = cache
        self.name = name

    def _key(self, index: int) -> str:
        return f"{self.name}#{index}"

    def find(self, index: int, segment: QuantSegment, kernel_type: int) -> torch.Tensor | None:
        return self.cache.find(self._key(index), segment, kernel_type)

    def keep(self, index: int, segment: QuantSegment, kernel_type: int, data: torch.Tensor) -> None:
        self.cache.keep(self._key(index), segment, kernel_type, data)

    def reject(self, index: int, reason: str) -> None:
        self.cache.reject(self._key(index), reason)

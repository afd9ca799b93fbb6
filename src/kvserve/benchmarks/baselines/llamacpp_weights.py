"""The GGUF file llama.cpp runs in the benchmarks: the model's own file, or a BF16 copy of it.

kvserve dequantizes a quantized GGUF and computes in float32 or bf16. llama.cpp
on the original file (SmolLM2's Q4_1) runs other arithmetic: 4-bit dot
products over a quarter of the bytes. For a like-for-like row the benchmarks
give llama.cpp a BF16 GGUF written from the same weights:

- every tensor dequantized with gguf-py (the code kvserve's loader uses);
- matrices stored as BF16 (rounded to nearest even), 1-D tensors (the norms)
  kept in F32, as llama.cpp's own converter does for ``--outtype bf16``;
- tensor names, order and layout as stored (llama.cpp's q/k row order stays:
  llama.cpp reads this file, not kvserve);
- every metadata key/value copied byte for byte (architecture, hyperparameters,
  tokenizer, chat template), except ``general.file_type``, which says BF16.

The copy is written once and cached under ``$KVSERVE_CACHE_DIR/llamacpp/``,
named by a hash of the source file's contents, into a temporary name renamed
into place, so concurrent benchmark runs never see half a file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import gguf
import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.loader import ModelSource
from kvserve.loader.gguf_config import gguf_architecture
from kvserve.loader.gguf_file import open_gguf
from kvserve.loader.gguf_types import GGUFField, GGUFFile, GGUFTensor
from kvserve.loader.gguf_weights import dequantize_tensor
from kvserve.private_cache import atomic_target, cache_root, is_trusted_file, private_cache_dir

LlamaCppWeights = Literal["bf16", "source"]
WEIGHT_CHOICES: tuple[LlamaCppWeights, ...] = ("bf16", "source")
# What each choice gives llama.cpp, in the words the benchmarks print.
WEIGHT_ORIGINS: dict[LlamaCppWeights, str] = {
    "source": "the model's file as stored, the one kvserve loads",
    "bf16": "a BF16 copy of the model's weights",
}

# Part of the cache key: bump it when the written file changes for the same source.
_FORMAT_VERSION = b"kvserve-bf16-gguf-1"
_HASH_CHUNK_BYTES = 16 * 1024**2

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# Written by GGUFWriter itself (the header's counts, the architecture) or replaced here.
_NOT_COPIED = frozenset({gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE})


def llamacpp_model_file(source: ModelSource, weights: LlamaCppWeights) -> Path:
    """The GGUF llama.cpp should load for ``source``: the file itself or its cached BF16 copy.

    Raises :class:`ModelLoadError` when ``source`` is not a GGUF file (llama.cpp
    reads GGUF only, and converting a Hugging Face folder is out of scope here).
    """
    if source.kind != "gguf":
        raise ModelLoadError(
            f"the llama.cpp baseline needs a GGUF model; {source.name!r} is a Hugging Face "
            "folder (pass a .gguf file or an alias such as smollm2-135m-instruct)"
        )
    if weights == "source":
        return source.path
    return cached_bf16_gguf(source.path)


def bf16_gguf_path(source_path: Path) -> Path:
    """Where the BF16 copy of ``source_path`` is cached (it may not exist yet)."""
    digest = hashlib.sha256(_FORMAT_VERSION)
    with source_path.open("rb") as source:
        while chunk := source.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    stem = source_path.name.removesuffix(".gguf")
    return cache_root() / "llamacpp" / f"{stem}-{digest.hexdigest()[:16]}.bf16.gguf"


def cached_bf16_gguf(source_path: Path) -> Path:
    """The BF16 copy of ``source_path``, written first if the cache does not hold it."""
    target = bf16_gguf_path(source_path)
    private_cache_dir("llamacpp")
    if is_trusted_file(target):
        return target
    print(f"writing a BF16 copy of {source_path.name} for llama.cpp: {target}", flush=True)
    with atomic_target(target, ".part") as tmp_path:
        write_bf16_gguf(source_path, tmp_path)
    return target


def stored_type(tensor: GGUFTensor) -> gguf.GGMLQuantizationType:
    """The type a tensor gets in the BF16 copy: F32 for 1-D tensors, BF16 for the rest."""
    return Q.F32 if len(tensor.shape) <= 1 else Q.BF16


def write_bf16_gguf(source_path: Path, target: Path) -> None:
    """Write the BF16 copy of the GGUF file ``source_path`` to ``target``, one tensor at a time."""
    reader = open_gguf(source_path)
    writer = gguf.GGUFWriter(target, gguf_architecture(reader))
    copy_metadata(reader, writer, lambda name: name not in _NOT_COPIED)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    plans = [
        TensorPlan(tensor.name, tuple(tensor.array_shape), stored_type(tensor))
        for tensor in reader.tensors
    ]
    write_tensors_streamed(writer, plans, (_converted(tensor) for tensor in reader.tensors))


def copy_metadata(reader: GGUFFile, writer: gguf.GGUFWriter, keep: Callable[[str], bool]) -> None:
    """Copy the metadata keys of ``reader`` that ``keep`` accepts into ``writer``, byte for byte."""
    for field in reader.fields.values():
        if not keep(field.name):
            continue
        value, value_type, item_type = _raw_value(field)
        writer.add_key_value(field.name, value, value_type, sub_type=item_type)
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.data_alignment = int(value)


class TensorPlan(NamedTuple):
    """One tensor of a GGUF being written: its name, numpy-order shape and stored type."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType  # F32 (float32 values) or BF16 (bf16 bits as uint16)


def write_tensors_streamed(
    writer: gguf.GGUFWriter, plans: list[TensorPlan], values: Iterable[np.ndarray]
) -> None:
    """Write the header, the metadata and the tensors of ``plans``, then close ``writer``.

    ``values`` yields each tensor's data in the order of ``plans``; each is
    written as it comes, so a file of many gigabytes never has to fit in memory.
    The header lists every tensor before any data: first the table, then the
    data in order.
    """
    for plan in plans:
        dtype = np.dtype(np.float32 if plan.qtype == Q.F32 else np.uint16)
        nbytes = int(np.prod(plan.shape)) * dtype.itemsize
        writer.add_tensor_info(plan.name, list(plan.shape), dtype, nbytes, raw_dtype=plan.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for value in values:
            writer.write_tensor_data(value)
    finally:
        writer.close()


def _converted(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values in its stored type: float32, or bf16 bits as uint16."""
    values = dequantize_tensor(tensor)
    if stored_type(tensor) == Q.F32:
        return values.numpy()
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _raw_value(field: GGUFField) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """A metadata value as GGUFWriter takes it: strings as their raw bytes, never re-encoded."""
    if field.value_type == V.ARRAY and field.item_type != V.STRING:
        return field.raw.tolist(), field.value_type, field.item_type
    return field.raw, field.value_type, field.item_type

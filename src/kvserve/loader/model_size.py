"""Refuse a config whose weights could not possibly be in the model's files.

Each hyperparameter is bounded on its own (:mod:`kvserve.models.arch_limits`),
but their product is what gets allocated: a 300 KB file claiming a 65,536-wide,
1,024-layer model would have the engine allocate terabytes before the first
missing tensor is noticed. Every weight a model holds is stored in its files
with at least one bit (the most compressed GGUF types take 1.56 bits per
weight), so a config that describes more than eight weights per stored byte
is refused before the model is built. What the engine then allocates for the
weights is at most 32 times the files' size (float32), whatever the config says.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.loader.hf_folder import safetensors_files
from kvserve.loader.source import ModelSource
from kvserve.models.arch_config import ArchConfig

# The fewest bits any supported format stores a weight in, rounded down.
MIN_BITS_PER_WEIGHT = 1


def weight_files(source: ModelSource) -> list[Path]:
    """The files that hold ``source``'s weights."""
    return [source.path] if source.kind == "gguf" else safetensors_files(source.path)


def check_weights_fit_files(source: ModelSource, arch: ArchConfig) -> None:
    """Raise ModelLoadError when ``arch`` has more weights than ``source``'s files can hold."""
    files = weight_files(source)
    try:
        num_bytes = sum(path.stat().st_size for path in files)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the weights of {source.name!r}: {exc}") from exc
    num_weights = arch.num_parameters()
    if num_weights * MIN_BITS_PER_WEIGHT > num_bytes * 8:
        names = ", ".join(path.name for path in files[:3]) + (", ..." if len(files) > 3 else "")
        raise ModelLoadError(
            f"the config of {source.name!r} describes {num_weights:,} weights, more than its "
            f"weight files ({names}: {num_bytes:,} bytes) can hold at "
            f"{MIN_BITS_PER_WEIGHT} bit per weight",
            field="num_parameters",
        )

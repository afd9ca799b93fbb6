"""Read a Hugging Face model folder: ``config.json`` and ``*.safetensors`` weights.

Weights are yielded one tensor at a time straight from the memory-mapped
safetensors files, in their stored dtype and under their stored names, so the
caller can copy each into its parameter and drop it: the checkpoint is never
held in memory next to the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvserve.errors import ModelLoadError
from kvserve.loader.folder_paths import checked_folder_file
from kvserve.models.arch_config import ArchConfig

_CONFIG_FILE = "config.json"
_INDEX_FILE = "model.safetensors.index.json"

# config.json and the shard index are a few KB to a few MB (the index of a
# model with 100,000 tensors); a bigger one is not what it claims to be.
_MAX_JSON_BYTES = 64 * 1024**2

# Old Llama checkpoints store the RoPE inverse frequencies as a buffer. They are
# derived from the config, not learned, so the model recomputes them.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_arch_config(folder: Path) -> ArchConfig:
    """Parse ``folder/config.json`` into an :class:`ArchConfig`."""
    config = read_folder_json(folder, _CONFIG_FILE)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / _CONFIG_FILE} must hold a JSON object", field=_CONFIG_FILE)
    return ArchConfig.from_hf_dict(config)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``, in a stable order, each checked by :func:`checked_folder_file`.

    With a shard index only the files it lists count: some repos (Mistral's)
    also ship a ``consolidated.safetensors`` holding the same weights under
    other names, which must not be read twice.
    """
    if os.path.lexists(folder / _INDEX_FILE):
        index = read_folder_json(folder, _INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(
                f"{folder / _INDEX_FILE} has no weight_map object of tensor → shard names",
                field=_INDEX_FILE,
            )
        if not all(isinstance(name, str) for name in weight_map.values()):
            raise ModelLoadError(
                f"{folder / _INDEX_FILE} maps a tensor to a shard name that is not a string",
                field=_INDEX_FILE,
            )
        shard_names = sorted(set(weight_map.values()))
        return [checked_folder_file(folder, name, _INDEX_FILE) for name in shard_names]
    names = sorted(path.name for path in folder.glob("*.safetensors"))
    if not names:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return [checked_folder_file(folder, name, "the folder") for name in names]


def read_folder_json(folder: Path, name: str) -> Any:
    """The parsed JSON file ``folder/name``, refused past :data:`_MAX_JSON_BYTES`."""
    path = checked_folder_file(folder, name, "the folder")
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise ModelLoadError(
                f"{path} is larger than {_MAX_JSON_BYTES} bytes; not a model's {name}", field=name
            )
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", field=name) from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", field=name) from exc


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every stored tensor of every shard, one at a time."""
    for path in safetensors_files(folder):
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}", field=path.name) from exc
        with handle as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if name.endswith(_DERIVED_SUFFIXES):
                    continue
                try:
                    tensor = shard.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(
                        f"cannot read tensor {name} from {path}: {exc}", field=name
                    ) from exc
                yield name, tensor

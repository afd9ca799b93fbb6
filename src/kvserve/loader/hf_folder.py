"""Read a Hugging Face model folder: ``config.json`` and ``*.safetensors`` weights.

Weights are yielded one tensor at a time straight from the memory-mapped
safetensors files, in their stored dtype and under their stored names, so the
caller can copy each into its parameter and drop it: the checkpoint is never
held in memory next to the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.errors import ModelLoadError
from kvserve.models.arch_config import ArchConfig

_INDEX_FILE = "model.safetensors.index.json"

# Old Llama checkpoints store the RoPE inverse frequencies as a buffer. They are
# derived from the config, not learned, so the model recomputes them.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_arch_config(folder: Path) -> ArchConfig:
    """Parse ``folder/config.json`` into an :class:`ArchConfig`."""
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object")
    return ArchConfig.from_hf_dict(config)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``, in a stable order.

    With a shard index only the files it lists count: some repos (Mistral's)
    also ship a ``consolidated.safetensors`` holding the same weights under
    other names, which must not be read twice.
    """
    index_path = folder / _INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index_path} is not a valid shard index: {exc}") from exc
        shards = [folder / name for name in shard_names]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists missing shards: {', '.join(missing)}")
        return shards
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return files


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every stored tensor of every shard, one at a time."""
    for path in safetensors_files(folder):
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        with handle as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if name.endswith(_DERIVED_SUFFIXES):
                    continue
                try:
                    tensor = shard.get_tensor(name)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(f"cannot read tensor {name} from {path}: {exc}") from exc
                yield name, tensor

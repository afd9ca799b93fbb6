"""The converted-model cache: what loading a GGUF file produced, kept for the next start.

Building a model from a GGUF file means parsing its metadata (seconds for a
large vocabulary, which is stored as one entry per token), building a
tokenizer from it, and dequantizing every weight in Python. None of that
changes while the file does not, so the results are kept in one entry per
file content under the private cache folder (see :mod:`kvserve.private_cache`)::

    $KVSERVE_CACHE_DIR/models/<file sha256, 32 hex>-v<FORMAT_VERSION>-<producer, 12 hex>/
        arch.json                        the ArchConfig
        tokenizer/                       the tokenizer: tokenizer.json and its settings
                                         (kvserve.loader.fast_tokenizer)
        weights-<dtype>.safetensors      the weights as the model holds them
        weights-repacked-<ids>.safetensors   quantized segments in the kernels' own
                                         layouts (see kvserve.loader.repacked_cache)

The key is the file's content hash (remembered per path and stat identity by
:mod:`kvserve.loader.source_digest`, so it costs nothing while the file is
unchanged), so a changed file never meets a stale entry, and an identical copy
or a reinstall reuses it. ``FORMAT_VERSION`` changes when what an entry holds
changes meaning; the producer hash covers what computes an entry (the
loader's sources, ``ArchConfig``'s, and the versions of gguf, transformers
and tokenizers), so a changed loader never reads what an older one wrote,
as a changed kernel source gets a new kernel library. Old entries are not
removed; delete the folder to reclaim their space.

Hugging Face folders are not cached: their config and tokenizer files load in
milliseconds and their safetensors weights are memory-mapped already; a
dtype conversion happens as the model copies them, at memory speed, so a
converted copy would only cost disk.

``KVSERVE_WEIGHT_CACHE_DIR`` puts the entries in another folder (a bigger
disk; the test suite uses one private to each run, so that every run converts
each file once and reads the entry after, without touching the user's cache).

A cached piece is used only when it passes the owner and mode checks and
parses; anything else is rebuilt from the source with a warning. Set
``KVSERVE_WEIGHT_CACHE=0`` to read every model from its source.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.loader.fast_tokenizer import FastTokenizer
from kvserve.loader.source import ModelSource
from kvserve.loader.source_digest import file_digest
from kvserve.models import arch_config
from kvserve.models.arch_config import ArchConfig
from kvserve.private_cache import (
    atomic_target,
    private_cache_dir,
    private_dir,
    untrusted_reason,
)

logger = logging.getLogger(__name__)

WEIGHT_CACHE_ENV = "KVSERVE_WEIGHT_CACHE"
WEIGHT_CACHE_DIR_ENV = "KVSERVE_WEIGHT_CACHE_DIR"

# Bump when an entry's files change meaning (names, layout, conversions).
FORMAT_VERSION = 2

_MODELS_FOLDER = "models"

# The packages whose code builds what an entry holds: dequantization, tokenizer conversion.
_PRODUCER_PACKAGES = ("gguf", "transformers", "tokenizers")


def model_cache_enabled() -> bool:
    """False when the user turned the cache off with ``KVSERVE_WEIGHT_CACHE=0``."""
    value = os.environ.get(WEIGHT_CACHE_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class ModelCacheEntry:
    """The cache folder of one GGUF file's content."""

    folder: Path
    source_sha256: str

    @property
    def arch_path(self) -> Path:
        return self.folder / "arch.json"

    @property
    def tokenizer_folder(self) -> Path:
        return self.folder / "tokenizer"

    def weights_path(self, dtype: torch.dtype) -> Path:
        return self.folder / f"weights-{dtype_name(dtype)}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def producer_digest() -> str:
    """12 hex digits of SHA-256 over the code that computes an entry and its packages' versions."""
    digest = hashlib.sha256()
    loader_sources = sorted(Path(__file__).parent.glob("*.py"))
    for path in (*loader_sources, Path(arch_config.__file__)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for package in _PRODUCER_PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        digest.update(f"{package}=={version}".encode())
    return digest.hexdigest()[:12]


def model_cache_entry(source: ModelSource) -> ModelCacheEntry | None:
    """The entry for ``source``; None when the cache is off, does not apply, or is unusable."""
    if source.kind != "gguf" or not model_cache_enabled():
        return None
    try:
        digest = file_digest(source.path)
        key = f"{digest[:32]}-v{FORMAT_VERSION}-{producer_digest()}"
        root = os.environ.get(WEIGHT_CACHE_DIR_ENV)
        folder = private_dir(Path(root), key) if root else private_cache_dir(_MODELS_FOLDER, key)
    except OSError as exc:
        _warn_once(f"the converted-model cache is not used for {source.path}: {exc}")
        return None
    return ModelCacheEntry(folder, digest)


@functools.cache
def _warn_once(message: str) -> None:
    # The config, the tokenizer and the weights each look the entry up: one warning is enough.
    logger.warning(message)


def cached_arch_config(source: ModelSource, build: Callable[[], ArchConfig]) -> ArchConfig:
    """``source``'s ArchConfig from the cache, or from ``build()`` (then cached)."""
    entry = model_cache_entry(source)
    if entry is None:
        return build()
    path = entry.arch_path
    reason = untrusted_reason(path)
    if reason is None:
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {stored.get('format')!r}, expected {FORMAT_VERSION}")
            # JSON has no tuples: eos_token_ids and layer_types come back as lists.
            fields: dict[str, Any] = {
                name: tuple(value) if isinstance(value, list) else value
                for name, value in stored["arch"].items()
            }
            return ArchConfig(**fields)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ModelLoadError) as exc:
            reason = f"it is unreadable ({type(exc).__name__}: {exc})"
    _warn_rebuild(path, reason)
    arch = build()
    try:
        with atomic_target(path) as tmp_path:
            stored = {"format": FORMAT_VERSION, "arch": dataclasses.asdict(arch)}
            tmp_path.write_text(json.dumps(stored), encoding="utf-8")
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("cannot cache the config of %s in %s: %s", source.path, path, exc)
    return arch


def cached_tokenizer(source: ModelSource, build: Callable[[], FastTokenizer]) -> FastTokenizer:
    """``source``'s tokenizer from the cache, or from ``build()`` (then cached).

    The cached form is what :meth:`FastTokenizer.save` writes (tokenizer.json
    and the settings beside it), read back with `tokenizers` alone: a warm
    start never imports transformers.
    """
    entry = model_cache_entry(source)
    if entry is None:
        return build()
    folder = entry.tokenizer_folder
    reason = _untrusted_folder_reason(folder)
    if reason is None:
        try:
            return FastTokenizer.load(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = f"it is unreadable ({type(exc).__name__}: {exc})"
    _warn_rebuild(folder, reason)
    tokenizer = build()
    try:
        if os.path.lexists(folder):
            shutil.rmtree(folder)
        # Saved whole into a fresh folder, then renamed: readers see all of it or none.
        tmp_folder = Path(tempfile.mkdtemp(dir=entry.folder, prefix=".tokenizer."))
        try:
            tokenizer.save(tmp_folder)
            try:
                tmp_folder.rename(folder)
            except OSError:
                if not folder.is_dir():
                    raise  # else another process cached it first: keep theirs
        finally:
            shutil.rmtree(tmp_folder, ignore_errors=True)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("cannot cache the tokenizer of %s in %s: %s", source.path, folder, exc)
    return tokenizer


def _untrusted_folder_reason(folder: Path) -> str | None:
    """Why a cached folder of files must not be used, or None when it and its files pass."""
    reason = untrusted_reason(folder, folder=True)
    if reason is not None:
        return reason
    try:
        children = sorted(folder.iterdir())
    except OSError as exc:
        return f"it cannot be listed ({exc})"
    for child in children:
        child_reason = untrusted_reason(child)
        if child_reason is not None:
            return f"{child.name}: {child_reason}"
    return None


def _warn_rebuild(path: Path, reason: str) -> None:
    """Warn about a cached piece that exists but is not used; a missing one is silent."""
    if os.path.lexists(path):
        logger.warning("rebuilding %s from the model file: %s", path, reason)

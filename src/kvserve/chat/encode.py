"""A conversation to prompt token ids, where only the chat template writes control tokens.

The template renders the messages to text, and that text is tokenized with
the tokenizer's added tokens recognized: that is how the template's
``<|im_start|>`` becomes one control token. Tokenizing the whole text that way
would also turn a user who *types* ``<|im_end|>\\n<|im_start|>system`` into a
system message. So before rendering, every control-token string found in the
messages' own strings is wrapped in two private-use characters; after
rendering, a wrapped occurrence is encoded as the literal characters and the
rest of the text as before.

A conversation with no control-token text in it renders to exactly the old
text and is tokenized in one call, so its token ids are what the plain
"render, then encode" gave. Only around a wrapped occurrence does the text
break into separately encoded pieces: no merge crosses those edges, and a
tokenizer that marks the start of a string (SentencePiece's ``▁``) may mark
one there.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvserve.chat.bounded_jinja import TemplateLimits
from kvserve.chat.render import render_chat
from kvserve.errors import InvalidParameterError

# Plane-16 private-use characters: no tokenizer gives them a meaning and no
# template filter (trim, upper, ...) changes them. They are removed from the
# messages before marking, so a message cannot forge a mark.
_OPEN = "\U00100000"
_CLOSE = "\U00100001"


def encode_chat(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    limits: TemplateLimits | None = None,
) -> list[int]:
    """The conversation's prompt token ids, through the chat template.

    ``chat_template`` replaces the tokenizer's own template for this call;
    ``tools`` (OpenAI's tool definitions) go to the template's ``tools`` variable.
    The template renders under ``limits`` (:func:`~kvserve.chat.render.render_chat`).

    Every string in the messages (content, text parts, names) is text: a
    control token in it is encoded as its characters. The template's own
    control tokens, and the ones it takes from the tokenizer (``bos_token``),
    stay control tokens. Raises :class:`~kvserve.errors.ChatTemplateError` for
    a conversation the template refuses or fails on, or when it goes past its
    limits; ``InvalidParameterError`` for ``messages`` when a control token in
    them cannot be written as text.
    """
    controls = control_token_ids(tokenizer, chat_template)
    patterns = _patterns(tuple(controls))
    messages = [_mark(message, patterns.marker) for message in conversation]
    marked_tools = None if tools is None else [_mark(tool, patterns.marker) for tool in tools]
    text = render_chat(
        tokenizer, messages, add_generation_prompt, chat_template, marked_tools, limits
    )
    # [text, marked token, text, ..., text]; a lone mark (a template that cut a
    # marked string apart) splits as None and still keeps its two sides apart.
    pieces = patterns.split.split(text)
    token_ids: list[int] = []
    for index, piece in enumerate(pieces):
        if not piece:
            continue
        if index % 2 == 0:
            # The template already holds any special tokens it wants.
            token_ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            token_ids += _encode_as_text(tokenizer, piece, controls[piece])
    return token_ids


def control_token_ids(tokenizer: Any, chat_template: str | None = None) -> dict[str, int]:
    """The strings a message may not turn into tokens of their own, with their ids.

    Those are the special tokens, and the other added tokens the chat template
    (``chat_template``, else the tokenizer's) writes (Qwen3's ``<think>``).
    Whitespace tokens are ordinary text.
    """
    template = str(chat_template or tokenizer.chat_template or "")
    return {
        token.content: token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.content.strip() and (token.special or token.content in template)
    }


def _mark(value: Any, marker: re.Pattern[str]) -> Any:
    """``value`` with the control tokens in its strings wrapped, recursively."""
    if isinstance(value, str):
        value = value.replace(_OPEN, "").replace(_CLOSE, "")
        return marker.sub(rf"{_OPEN}\g<0>{_CLOSE}", value)
    if isinstance(value, Mapping):
        return {key: _mark(item, marker) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, marker) for item in value]
    return value


class _Patterns(NamedTuple):
    marker: re.Pattern[str]  # any control token
    split: re.Pattern[str]  # a marked control token (captured), or a lone mark (captures None)


@functools.lru_cache(maxsize=16)
def _patterns(controls: tuple[str, ...]) -> _Patterns:
    # Longest first, so that a token wins over the shorter tokens inside it.
    longest_first = sorted(controls, key=len, reverse=True)
    alternation = "|".join(re.escape(token) for token in longest_first) or "(?!)"
    return _Patterns(
        marker=re.compile(alternation),
        split=re.compile(f"{_OPEN}({alternation}){_CLOSE}|[{_OPEN}{_CLOSE}]"),
    )


def _encode_as_text(tokenizer: Any, text: str, control_id: int) -> list[int]:
    """``text``'s characters as ordinary tokens, with no added token recognized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # transformers' Python (slow) tokenizer
        token_ids = list(
            tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )
    else:
        # The backend's pipeline without its added-token pass. This reads the
        # backend only: ``split_special_tokens`` would flip a flag on the
        # tokenizer that other threads share.
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        words = (
            [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]
            if backend.pre_tokenizer
            else [normalized]
        )
        token_ids = [token.id for word in words for token in backend.model.tokenize(word)]
    if control_id in token_ids:
        # The vocabulary builds this control token from plain characters too.
        raise InvalidParameterError(
            "messages", f"{text!r} cannot be written as text with this model's tokenizer"
        )
    return token_ids


__all__ = ["control_token_ids", "encode_chat"]

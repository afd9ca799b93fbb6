"""Incremental detokenization and stop strings.

Decoding a growing token list from scratch every step costs O(n^2). Instead
each step decodes a short window: the tokens since the last emitted text plus
a few before it for context (a token's text can depend on its neighbour, e.g.
a leading space, or bytes of one character split over tokens). Text is
emitted only once it no longer ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:
    from kvserve.loader.fast_tokenizer import AnyTokenizer

# Prompt tokens kept as left context for the first output tokens.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def decode_tokens(
    tokenizer: AnyTokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True
) -> str:
    """The text of ``token_ids``."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


def token_decoder(
    tokenizer: AnyTokenizer, skip_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """The quickest exact ``decode`` of ``tokenizer``, for decoding a few tokens per step.

    A fast tokenizer's ``decode`` converts its arguments and then calls its Rust
    backend; where it would not also clean up spaces afterwards, calling the
    backend directly gives the same text for a fraction of the cost (two calls a
    token for every running request add up to milliseconds a step at hundreds of
    requests). Other tokenizers go through ``decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        rust_decode = backend.decode
        return lambda token_ids: rust_decode(token_ids, skip_special_tokens=skip_special_tokens)
    return lambda token_ids: decode_tokens(tokenizer, token_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one completion's tokens into text as they arrive and watches for stop strings."""

    def __init__(
        self,
        tokenizer: AnyTokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = token_decoder(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._tokens = context
        # _tokens[_prefix_offset:_read_offset] is context already turned into text;
        # tokens from _read_offset on are not yet in output_text.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._stopped = False

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._decode(list(token_ids))

    def append(self, token_id: int) -> str | None:
        """Add one generated token's text; return the stop string it completed, if any.

        After a stop string matched, ``output_text`` ends before it (or after
        it, with include_stop_str_in_output) and further calls do nothing.
        """
        if self._stopped:
            return None
        self._tokens.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str | None:
        """At the end of the completion, emit text still held back for an incomplete character."""
        if self._stopped or self._read_offset == len(self._tokens):
            return None
        return self._emit(final=True)

    def _emit(self, final: bool) -> str | None:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return None
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return None  # the last token may be the first bytes of a character
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        previous_len = len(self.output_text)
        self.output_text += new_text
        return self._check_stop(previous_len)

    def _check_stop(self, previous_len: int) -> str | None:
        matches = []
        for stop in self.stop:
            # Only a match that ends inside the new text is new.
            index = self.output_text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1:
                matches.append((index, stop))
        if not matches:
            return None
        index, stop = min(matches)  # the earliest stop string in the text wins
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self._stopped = True
        return stop


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (0 if none).

    A stream must hold those characters back: the next tokens may complete the
    stop string, and then they are not part of the output. Text before them
    can never be cut by a later match, so it is safe to send.
    """
    longest = 0
    for stop_string in stop:
        # Only starts within the last len(stop_string) - 1 characters can leave a partial match.
        window_start = max(0, len(text) - len(stop_string) + 1)
        index = text.find(stop_string[0], window_start)
        while index != -1:
            if stop_string.startswith(text[index:]):
                longest = max(longest, len(text) - index)
                break  # the earliest start in the window is the longest for this stop string
            index = text.find(stop_string[0], index + 1)
    return longest

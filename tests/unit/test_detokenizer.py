"""Incremental detokenization gives the same text as decoding everything at once."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import IncrementalDetokenizer
from model_fixtures import TINY_VOCAB_SIZE, train_tiny_tokenizer


@functools.cache
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tiny_tokenizer()


def feed(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> str | None:
    for token_id in token_ids:
        stop = detokenizer.append(token_id)
        if stop is not None:
            return stop
    return detokenizer.flush()


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.text(min_size=1, max_size=30),
    output=st.lists(st.integers(0, TINY_VOCAB_SIZE - 1), max_size=40),
)
def test_incremental_text_equals_decoding_the_whole_output(prompt: str, output: list[int]) -> None:
    # Prompts are text, so they end on a whole character; outputs are any token ids.
    detokenizer = IncrementalDetokenizer(tokenizer(), tokenizer().encode(prompt))
    assert feed(detokenizer, output) is None
    assert detokenizer.output_text == tokenizer().decode(output, skip_special_tokens=True)


def test_text_split_across_tokens_of_one_character_is_emitted_once_complete() -> None:
    ids = tokenizer().encode("café ünïcode ✓")
    detokenizer = IncrementalDetokenizer(tokenizer(), [5])
    for token_id in ids:
        detokenizer.append(token_id)
        assert "\ufffd" not in detokenizer.output_text
    assert detokenizer.output_text == "café ünïcode ✓"


def test_stop_string_truncates_and_the_earliest_of_several_wins() -> None:
    ids = tokenizer().encode("the quick brown fox jumps over the lazy dog")
    detokenizer = IncrementalDetokenizer(tokenizer(), [5], stop=["lazy", "fox"])
    assert feed(detokenizer, ids) == "fox"
    assert detokenizer.output_text == "the quick brown "
    assert detokenizer.append(ids[-1]) is None  # nothing changes after a stop
    assert detokenizer.output_text == "the quick brown "


def test_stop_string_can_be_kept_in_the_output() -> None:
    ids = tokenizer().encode("numbers like 12, 345 and 6789")
    detokenizer = IncrementalDetokenizer(
        tokenizer(), [5], stop=["345"], include_stop_str_in_output=True
    )
    assert feed(detokenizer, ids) == "345"
    assert detokenizer.output_text == "numbers like 12, 345"


def test_a_fast_tokenizer_is_decoded_by_its_backend_with_the_same_text() -> None:
    # The per-step decode skips transformers' wrapper; the text must not change.
    from kvserve.engine.detokenizer import token_decoder

    fast = train_tiny_tokenizer()
    assert not fast.clean_up_tokenization_spaces
    ids = fast.encode("Hello, world! Ünïcode 日本 ✓ spaces  here")
    expected = {skip: fast.decode(ids, skip_special_tokens=skip) for skip in (True, False)}
    wrapper_calls: list[object] = []
    fast.decode = lambda *args, **kwargs: wrapper_calls.append(args)  # type: ignore[method-assign]
    for skip in (True, False):
        assert token_decoder(fast, skip)(ids) == expected[skip]
    assert wrapper_calls == []


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode() -> None:
    from kvserve.engine.detokenizer import token_decoder

    cleaning = train_tiny_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    ids = cleaning.encode("a , b . c ' d")
    assert token_decoder(cleaning)(ids) == cleaning.decode(ids, skip_special_tokens=True)
    detokenizer = IncrementalDetokenizer(cleaning, [])
    assert feed(detokenizer, ids) is None
    assert detokenizer.output_text == cleaning.decode(ids, skip_special_tokens=True)

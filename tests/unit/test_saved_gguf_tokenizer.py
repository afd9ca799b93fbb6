"""A GGUF's tokenizer read back from kvserve's cache equals the one built from the file.

The cache saves what transformers converts from the GGUF metadata and loads it
back as the generic fast tokenizer (loader/model_cache.py); the model's own
tokenizer class is only a way to build the same `tokenizers` object. Checked
on the shipped files: encodings of varied text (special tokens, whitespace,
scripts, a rendered chat), decodings of arbitrary ids, special ids, the chat
template.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve.errors import ModelLoadError
from kvserve.loader import resolve_model
from kvserve.loader.model_cache import _load_saved_tokenizer
from kvserve.loader.tokenizer import _build_tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé, 日本語のテキスト, Ελληνικά, русский, emoji 🙂👍",
    "code: def f(x):\n    return x ** 2  # square",
    "numbers 1234567890 3.14159 -42",
]


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_saved_tokenizer_tokenizes_as_the_converted_one(alias: str, tmp_path: Path) -> None:
    try:
        source = resolve_model(alias)
    except ModelLoadError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")
    built = _build_tokenizer(source)
    built.save_pretrained(tmp_path)
    saved = _load_saved_tokenizer(tmp_path)
    assert type(saved).__name__ == "TokenizersBackend"
    assert len(saved) == len(built) and saved.all_special_ids == built.all_special_ids
    assert (saved.bos_token_id, saved.eos_token_id) == (built.bos_token_id, built.eos_token_id)
    assert saved.chat_template == built.chat_template
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    # Gemma 3 270M is a base model: no chat template in its file.
    chat = built.apply_chat_template(turns, tokenize=False) if built.chat_template else ""
    specials = " ".join(built.all_special_tokens)
    for text in [*TEXTS, chat, specials + " between " + specials]:
        assert saved.encode(text) == built.encode(text), text
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(built)) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            assert saved.decode(ids, skip_special_tokens=skip) == built.decode(
                ids, skip_special_tokens=skip
            )

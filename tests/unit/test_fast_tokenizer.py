"""FastTokenizer (a GGUF model's tokenizer kept without transformers) against transformers.

The reference is transformers' own fast tokenizer for the same `tokenizers`
object: what it builds from a GGUF file's metadata (the shipped files), or a
small trained one. Compared: ids with and without special tokens, truncated
encodings, decodings of arbitrary ids, token strings, special tokens and ids,
the vocabulary and its added tokens, and the chat template's output. Also
what the model cache relies on: ``save`` then ``load`` gives the same
tokenizer, a malformed settings file is refused, and ``save_pretrained``
writes a folder transformers reads back as the same tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.errors import ModelLoadError
from kvserve.loader import resolve_model
from kvserve.loader.fast_tokenizer import SETTINGS_FILE, FastTokenizer
from model_fixtures import train_tiny_tokenizer, transformers_gguf_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé, 日本語のテキスト, Ελληνικά, русский, emoji 🙂👍",
    "code: def f(x):\n    return x ** 2  # square",
    "numbers 1234567890 3.14159 -42",
    "Don't stop , now . It 's here !",
    "",
]
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Tell me a story."},
]


def assert_same(fast: FastTokenizer, reference: Any, seed: int = 0) -> None:
    """Every call kvserve makes answers as transformers' tokenizer does."""
    assert len(fast) == len(reference) and fast.vocab_size == reference.vocab_size
    assert fast.get_vocab() == reference.get_vocab()
    assert fast.special_tokens_map == reference.special_tokens_map
    assert fast.all_special_tokens == reference.all_special_tokens
    assert fast.all_special_ids == reference.all_special_ids
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(fast, f"{name}_token") == getattr(reference, f"{name}_token"), name
        assert getattr(fast, f"{name}_token_id") == getattr(reference, f"{name}_token_id"), name
    added = {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    assert {i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()} == added
    assert fast.chat_template == reference.chat_template
    specials = " ".join(reference.all_special_tokens)
    rng = random.Random(seed)
    vocabulary = sorted(reference.get_vocab())
    scrambled = ["".join(rng.choice(vocabulary) for _ in range(12)) for _ in range(20)]
    for text in [*TEXTS, specials + " between " + specials, *scrambled]:
        for add in (True, False):
            expected = reference.encode(text, add_special_tokens=add)
            assert fast.encode(text, add_special_tokens=add) == expected, (text, add)
        ids = reference.encode(text)
        assert fast.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert fast.convert_ids_to_tokens(ids, skip_special_tokens=True) == (
            reference.convert_ids_to_tokens(ids, skip_special_tokens=True)
        )
        tokens = reference.convert_ids_to_tokens(ids)
        assert fast.convert_tokens_to_ids(tokens) == reference.convert_tokens_to_ids(tokens)
        for max_length in (2, 3, 8):
            expected = reference(text, truncation=True, max_length=max_length)["input_ids"]
            assert fast(text, truncation=True, max_length=max_length)["input_ids"] == expected
    # A string outside the vocabulary: the unknown token's id, or None without one.
    outside = "\u2603not-a-token\u2603"
    assert fast.convert_tokens_to_ids(outside) == reference.convert_tokens_to_ids(outside)
    assert fast.convert_tokens_to_ids([outside]) == reference.convert_tokens_to_ids([outside])
    for _ in range(50):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert fast.decode(ids, skip_special_tokens=skip) == expected, ids
    if reference.chat_template:
        for prompt in (False, True):
            text = reference.apply_chat_template(
                TURNS, tokenize=False, add_generation_prompt=prompt
            )
            rendered = fast.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=prompt)
            assert rendered == text
            ids = reference.apply_chat_template(TURNS, add_generation_prompt=prompt)
            ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
            assert fast.apply_chat_template(TURNS, add_generation_prompt=prompt) == ids


def round_trip(fast: FastTokenizer, folder: Path) -> FastTokenizer:
    folder.mkdir()
    fast.save(folder)
    return FastTokenizer.load(folder)


def test_a_trained_byte_level_bpe_answers_as_transformers(tmp_path: Path) -> None:
    reference = train_tiny_tokenizer()
    reference.add_special_tokens({"additional_special_tokens": ["[C]"]})
    reference.add_tokens(["<think>"])  # an added token that is not special
    reference.chat_template = (
        "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast = FastTokenizer.from_transformers(reference)
    assert_same(fast, reference)
    assert_same(round_trip(fast, tmp_path / "saved"), reference)
    # A Hugging Face folder written from it keeps the extra special token too.
    fast.save_pretrained(tmp_path / "hf")
    assert_same(fast, AutoTokenizer.from_pretrained(tmp_path / "hf"))


def _wordpiece_reference() -> PreTrainedTokenizerFast:
    """A BERT-like tokenizer: WordPiece, [CLS] ... [SEP] added, spaces cleaned up on decode."""
    backend = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)  # so that only the wrapper cleans up
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"], show_progress=False
    )
    backend.train_from_iterator([t for t in TEXTS if t] * 20, trainer)
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        clean_up_tokenization_spaces=True,
    )


def test_wordpiece_cleans_up_spaces_and_truncates_inside_its_special_tokens(
    tmp_path: Path,
) -> None:
    reference = _wordpiece_reference()
    fast = FastTokenizer.from_transformers(reference)
    assert fast.clean_up_tokenization_spaces is True
    ids = reference.encode("don't stop , now .")
    # The clean-up is visible: without it the text would keep " ," and " .".
    assert " ," not in fast.decode(ids) and fast.decode(ids) == reference.decode(ids)
    raw = fast.decode(ids, clean_up_tokenization_spaces=False)
    assert " ," in raw and raw == reference.decode(ids, clean_up_tokenization_spaces=False)
    truncated = fast("numbers 1234567890 3.14159", truncation=True, max_length=4)["input_ids"]
    assert len(truncated) == 4 and truncated[0] == fast.convert_tokens_to_ids("[CLS]")
    assert truncated[-1] == fast.convert_tokens_to_ids("[SEP]")
    assert_same(fast, reference)
    assert_same(round_trip(fast, tmp_path / "saved"), reference)


@pytest.mark.parametrize(
    "settings_change",
    [
        {"format": 99},
        {"special_tokens_map": {"bos_token": 7}},
        {"special_tokens_map": {"surprise_token": "<s>"}},
        {"extra_special_tokens": "<s>"},
        {"chat_template": ["a", "b"]},
        {"truncation_side": "middle"},
    ],
)
def test_a_malformed_settings_file_is_refused(
    tmp_path: Path, settings_change: dict[str, Any]
) -> None:
    fast = FastTokenizer.from_transformers(train_tiny_tokenizer())
    fast.save(tmp_path)
    settings = json.loads((tmp_path / SETTINGS_FILE).read_text())
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**settings, **settings_change}))
    with pytest.raises(ValueError):
        FastTokenizer.load(tmp_path)


def test_a_truncated_backend_file_is_refused(tmp_path: Path) -> None:
    fast = FastTokenizer.from_transformers(train_tiny_tokenizer())
    fast.save(tmp_path)
    backend = tmp_path / "tokenizer.json"
    backend.write_text(backend.read_text()[:1000])
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        FastTokenizer.load(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_shipped_gguf_tokenizer_answers_as_transformers_conversion(
    alias: str, tmp_path: Path
) -> None:
    try:
        source = resolve_model(alias)
    except ModelLoadError as exc:
        pytest.skip(f"{alias} is not installed: {exc}")
    built = transformers_gguf_tokenizer(source.path)
    fast = round_trip(FastTokenizer.from_transformers(built), tmp_path / "saved")
    assert_same(fast, built)
    # A Hugging Face folder written from it loads in transformers as the same tokenizer.
    fast.save_pretrained(tmp_path / "hf")
    saved = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert saved.special_tokens_map == built.special_tokens_map
    assert saved.chat_template == built.chat_template
    for text in TEXTS:
        assert saved.encode(text) == built.encode(text)
        assert saved.decode(saved.encode(text)) == built.decode(built.encode(text))

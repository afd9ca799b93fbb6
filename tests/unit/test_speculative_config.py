"""``speculative_config``: validation, and the ways users pass it."""

from __future__ import annotations

import argparse

import pytest

from kvserve.config import EngineConfig, SpeculativeConfig
from kvserve.entrypoints.args import add_engine_args, engine_config_from_args
from kvserve.errors import InvalidParameterError


def test_defaults_and_from_dict() -> None:
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 5})
    assert config == SpeculativeConfig("ngram", 5, 2, 4)
    assert SpeculativeConfig.from_value(None) is None
    assert SpeculativeConfig.from_value(config) is config


def test_from_json_text() -> None:
    config = SpeculativeConfig.from_value(
        '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    )
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 2)


@pytest.mark.parametrize(
    ("value", "param", "words"),
    [
        ({"method": "medusa"}, "speculative_config.method", "one of"),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "speculative_config.suffix_decoding_max_tree_depth",
            "1 to 64",
        ),
        (
            {"suffix_decoding_max_cached_requests": -1},
            "speculative_config.suffix_decoding_max_cached_requests",
            "0 to 100000",
        ),
        (
            {"suffix_decoding_min_token_prob": 1.5},
            "speculative_config.suffix_decoding_min_token_prob",
            "0 to 1",
        ),
        (
            {"suffix_decoding_min_token_prob": "0.1"},
            "speculative_config.suffix_decoding_min_token_prob",
            "0 to 1",
        ),
        ({"method": "draft_model"}, "speculative_config.model", "needs the draft model"),
        ({"method": "draft_model", "model": " "}, "speculative_config.model", "needs the draft"),
        ({"method": "draft_model", "model": 3}, "speculative_config.model", "needs the draft"),
        ({"model": "smollm2-135m-instruct"}, "speculative_config.model", "only the draft_model"),
        (
            {"method": "suffix", "model": "smollm2-135m-instruct"},
            "speculative_config.model",
            "only the draft_model",
        ),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "1 to 16"),
        ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens", "1 to 16"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens", "1 to 16"),
        ({"prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min", "1 to 64"),
        (
            {"prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_min",
            "at most prompt_lookup_max",
        ),
        ({"lookahead": 3}, "speculative_config", "unknown field"),
        ("{not json", "speculative_config", "not valid JSON"),
        ([1, 2], "speculative_config", "must be a dict"),
    ],
)
def test_bad_values_name_the_parameter(value: object, param: str, words: str) -> None:
    with pytest.raises(InvalidParameterError, match=words) as caught:
        SpeculativeConfig.from_value(value)
    assert caught.value.param == param


def test_suffix_method_and_its_fields() -> None:
    config = SpeculativeConfig.from_value(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 16,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_min_token_prob": 0.25,
        }
    )
    assert config is not None and config.method == "suffix"
    assert config.suffix_decoding_max_tree_depth == 16
    assert config.suffix_decoding_max_cached_requests == 0
    assert config.suffix_decoding_min_token_prob == 0.25


def test_draft_model_method_and_its_model() -> None:
    config = SpeculativeConfig.from_value(
        '{"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 5}'
    )
    assert config is not None and config.method == "draft_model"
    assert (config.model, config.num_speculative_tokens) == ("smollm2-135m-instruct", 5)
    assert SpeculativeConfig().model is None


def test_engine_args_take_it() -> None:
    config = EngineConfig.from_kwargs(
        "smollm2-135m-instruct", speculative_config={"num_speculative_tokens": 2}
    )
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig.from_kwargs("smollm2-135m-instruct").speculative_config is None


def test_cli_flag_is_parsed_into_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    args.model = "smollm2-135m-instruct"
    config = engine_config_from_args(args)
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=4)
    args = parser.parse_args([])
    args.model = "smollm2-135m-instruct"
    assert engine_config_from_args(args).speculative_config is None

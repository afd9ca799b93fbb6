"""The perplexity benchmark's windows and passage (``kvserve bench perplexity``)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.benchmarks import cli
from kvserve.benchmarks.offline.perplexity import scored_logprobs, text_windows
from kvserve.benchmarks.workloads.passage import passage_path, passage_text
from kvserve.errors import InvalidParameterError
from kvserve.outputs import Logprob, RequestOutput


def test_windows_are_consecutive_whole_and_led_by_bos_when_asked() -> None:
    tokens = list(range(100, 125))  # 25 tokens: three windows of 8, one token left over
    windows = text_windows(tokens, 8, None, None)
    assert windows == [tokens[0:8], tokens[8:16], tokens[16:24]]
    assert text_windows(tokens, 8, 2, 1) == [[1, *tokens[1:8]], [1, *tokens[9:16]]]


@pytest.mark.parametrize(
    ("n_ctx", "windows", "param"), [(2, None, "n_ctx"), (8, 0, "windows"), (64, None, "n_ctx")]
)
def test_bad_window_settings_name_the_flag(n_ctx: int, windows: int | None, param: str) -> None:
    with pytest.raises(InvalidParameterError, match=param):
        text_windows(list(range(25)), n_ctx, windows, None)


def test_scored_logprobs_are_the_prompt_tokens_own_from_the_given_position() -> None:
    entries = [None, {7: Logprob(-1.0, 2), 3: Logprob(-0.5, 1)}, {8: Logprob(-2.0, 1)}]
    output = RequestOutput("w", None, [6, 7, 8], [], prompt_logprobs=entries)
    assert scored_logprobs(output, 1) == [-1.0, -2.0]
    assert scored_logprobs(output, 2) == [-2.0]


def test_the_passage_ships_and_is_long_enough_for_several_windows() -> None:
    text = passage_text()
    assert passage_path().is_file()
    assert len(text.split()) > 3000  # about 4,000 tokens for a BPE tokenizer


def test_bench_has_a_perplexity_mode() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "perplexity", "--model", "m", "--n-ctx", "256", "--windows", "3"]
    )
    assert (args.n_ctx, args.windows, args.llamacpp_weights) == (256, 3, "source")

"""kv-memory: the three allocation schemes priced on one measured run per concurrency."""

from __future__ import annotations

import pytest

from kvserve.demos import DemoResult
from kvserve.demos.kv_memory import SCHEMES, Sizes, contiguous_capacity, draw_lengths
from kvserve.demos.plotting import MIB


@pytest.mark.parametrize(
    ("prompt", "tokens", "capacity"),
    [(1, 1, 1), (5, 5, 8), (8, 8, 8), (8, 9, 16), (100, 300, 512), (600, 900, 1000)],
)
def test_contiguous_buffer_doubles_from_the_prompt(prompt: int, tokens: int, capacity: int) -> None:
    assert contiguous_capacity(prompt, tokens, max_model_len=1000) == capacity


def test_lengths_are_seeded_and_in_range() -> None:
    sizes = Sizes()
    lengths = draw_lengths(sizes, 64, seed=5)
    assert lengths == draw_lengths(sizes, 64, seed=5) != draw_lengths(sizes, 64, seed=6)
    for prompt, output in lengths:
        assert sizes.min_prompt_tokens <= prompt <= sizes.max_prompt_tokens
        assert sizes.min_output_tokens <= output <= sizes.max_output_tokens


def test_paged_bytes_never_exceed_the_static_reservation(
    demo_results: dict[str, DemoResult],
) -> None:
    data = demo_results["kv-memory"].data
    assert [level["concurrency"] for level in data["levels"]] == [1, 2, 4, 8]
    for level in data["levels"]:
        peak = level["peak_bytes"]
        assert peak["needed"] <= peak["paged"] <= peak["static"]
        assert peak["needed"] <= peak["contiguous"] <= peak["static"]
        assert peak["paged"] == level["peak_blocks_used"] * data["kv_bytes_per_block"]
        for scheme in SCHEMES:
            assert level["waste_percent"][scheme] == 100.0 * (1 - peak["needed"] / peak[scheme])
        # A paged request wastes less than one block: its last, partly filled one.
        waste_bytes = peak["paged"] - peak["needed"]
        assert waste_bytes < level["concurrency"] * data["kv_bytes_per_block"]


def test_one_request_holds_its_whole_sequence_at_the_end(
    demo_results: dict[str, DemoResult],
) -> None:
    """Alone, a request's peak is its final length: prompt + output - 1 tokens (the last
    sampled token is never fed back), in whole blocks when paged."""
    data = demo_results["kv-memory"].data
    alone = data["levels"][0]
    num_tokens = alone["prompt_tokens"] + alone["output_tokens"] - 1
    assert alone["peak_bytes"]["needed"] == num_tokens * data["bytes_per_token"]
    assert alone["peak_blocks_used"] == -(-num_tokens // data["block_size"])
    assert alone["peak_bytes"]["static"] == data["max_model_len"] * data["bytes_per_token"]


def test_table_shows_the_data_in_mib(demo_results: dict[str, DemoResult]) -> None:
    result = demo_results["kv-memory"]
    (table,) = result.tables
    for row, level in zip(table.rows, result.data["levels"], strict=True):
        peak, waste = level["peak_bytes"], level["waste_percent"]
        assert row == (
            level["concurrency"],
            peak["needed"] / MIB,
            peak["static"] / MIB,
            waste["static"],
            peak["contiguous"] / MIB,
            waste["contiguous"],
            peak["paged"] / MIB,
            waste["paged"],
            level["peak_blocks_used"],
        )

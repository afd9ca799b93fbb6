"""``kvserve demo block-table`` on a tiny random Llama: the tables it prints agree with the
request's tokens and with the pool's own count of blocks in use (from the step trace)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvserve.demos import DemoResult, run_demo
from kvserve.demos.context import DemoContext
from kvserve.demos.registry import demo_names
from model_fixtures import save_tiny_model, train_tiny_tokenizer

BLOCK_SIZE = 4
SIZES = {
    "block_size": BLOCK_SIZE,
    "solo_max_tokens": 10,
    "max_tokens_each": (8, 12, 6, 10),
    "arrival_every": 2,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    model_dir = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())
    ctx = DemoContext(model=str(model_dir), dtype="float32", sizes=SIZES)
    return run_demo("block-table", ctx)


def assert_tiles(table: Sequence[Sequence[int]], num_tokens: int) -> None:
    """Logical blocks 0, 1, ... cover tokens [0, num_tokens) exactly, each full but the last."""
    assert [row[0] for row in table] == list(range(len(table)))
    assert len(table) == -(-num_tokens // BLOCK_SIZE)
    position = 0
    for _logical, _physical, first, last, fill in table:
        assert first == position and fill == last - first + 1
        assert 1 <= fill <= BLOCK_SIZE
        position = last + 1
    assert position == num_tokens
    assert all(row[4] == BLOCK_SIZE for row in table[:-1])
    assert len({row[1] for row in table}) == len(table) and 0 not in {row[1] for row in table}


def test_the_demo_is_registered() -> None:
    assert "block-table" in demo_names()


def test_the_lone_request_s_table_grows_one_block_per_boundary(result: DemoResult) -> None:
    solo = result.data["solo"]
    snapshots = solo["snapshots"]
    assert snapshots[0]["event"] == "prefill"
    assert snapshots[0]["computed_tokens"] == solo["prompt_tokens"]
    for snapshot in snapshots:
        # After a step, every token but the newest sampled one has K/V.
        assert snapshot["computed_tokens"] == solo["prompt_tokens"] + snapshot["output_tokens"] - 1
        assert_tiles(snapshot["table"], snapshot["computed_tokens"])
        # Alone in the engine, its table is every block the pool has handed out.
        assert len(snapshot["table"]) == snapshot["blocks_used_in_pool"]
    for before, after in itertools.pairwise(snapshots):
        assert len(after["table"]) == len(before["table"]) + 1
        assert [row[1] for row in after["table"][:-1]] == [row[1] for row in before["table"]]
    final_tokens = solo["prompt_tokens"] + solo["output_tokens"] - 1
    assert solo["blocks_at_finish"] == -(-final_tokens // BLOCK_SIZE)
    # The last step may start a block the request gives back at once (not snapshotted).
    assert len(snapshots[-1]["table"]) in (solo["blocks_at_finish"], solo["blocks_at_finish"] - 1)


def test_interleaved_tables_are_contiguous_but_their_blocks_are_scattered(
    result: DemoResult,
) -> None:
    snapshot = result.data["interleaved"]["snapshot"]
    tables: dict[str, list[list[int]]] = snapshot["tables"]
    assert set(tables) == {"r0", "r1", "r2", "r3"}
    for request_id, table in tables.items():
        assert_tiles(table, snapshot["computed_tokens"][request_id])
    physical = [row[1] for table in tables.values() for row in table]
    assert len(physical) == len(set(physical))  # no block has two owners
    assert len(physical) == snapshot["blocks_used_in_pool"]

    def consecutive(ids: list[int]) -> bool:
        return ids == list(range(ids[0], ids[0] + len(ids)))

    assert not all(consecutive([row[1] for row in table]) for table in tables.values())


def test_the_tables_and_files_hold_the_same_numbers(result: DemoResult, tmp_path: Path) -> None:
    solo_table, requests_table, interleaved_table = result.tables
    snapshot_rows = [row for s in result.data["solo"]["snapshots"] for row in s["table"]]
    assert [list(row[3:]) for row in solo_table.rows] == snapshot_rows
    assert len(requests_table.rows) == 4
    tables: dict[str, Any] = result.data["interleaved"]["snapshot"]["tables"]
    assert len(interleaved_table.rows) == sum(len(table) for table in tables.values())
    written = result.write(tmp_path)
    saved = json.loads(written.json_path.read_text(encoding="utf-8"))
    assert saved["data"]["interleaved"]["snapshot"]["tables"] == tables
    assert written.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

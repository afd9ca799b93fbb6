"""``prepare_inputs`` builds one slot mapping and set of block tables per KV cache group."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import TorchPagedAttention
from kvserve.core.block_pool import NULL_BLOCK_ID as NULL
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def scheduled(
    request_id: str, num_tokens: int, num_computed: int, num_new: int, tables: tuple
) -> ScheduledRequest:
    request = Request(request_id, list(range(num_tokens)), SamplingParams())
    request.num_computed_tokens = num_computed
    samples = num_computed + num_new == num_tokens
    return ScheduledRequest(request, num_new, tables, samples)


def slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_each_group_gets_its_own_slots_and_tables_and_its_window() -> None:
    # A prefill chunk (positions 9..14) and a decode (position 13), listed prefill first.
    chunk_tables = ([NULL, NULL, 11, 12], [21, 22, 23, 24])
    decode_tables = ([NULL, NULL, 13, 14], [31, 32, 33, 34])
    items = [
        scheduled("chunk", 15, 9, 6, chunk_tables),
        scheduled("decode", 14, 13, 1, decode_tables),
    ]
    inputs = prepare_inputs(items, BLOCK_SIZE, CPU, sliding_windows=(4, None))
    sliding, full = inputs.attn_layouts
    assert (sliding.sliding_window, full.sliding_window) == (4, None)
    # A backend builds one entry per group, in order; a layer of group 1 reads the full one.
    metadata = TorchPagedAttention().build_metadata(inputs.attn_layouts, torch.float32, 64)
    assert metadata.groups[0].layout is sliding and metadata.groups[1].layout is full
    assert inputs.positions.tolist() == [13, *range(9, 15)]  # the decode goes first
    for group, layout in enumerate((sliding, full)):
        expected = slots(decode_tables[group], range(13, 14)) + slots(
            chunk_tables[group], range(9, 15)
        )
        assert layout.slot_mapping.tolist() == expected
        assert layout.decode_block_tables.tolist() == [decode_tables[group]]
        assert layout.decode_seq_lens.tolist() == [14]
        [chunk] = layout.prefills
        assert (chunk.query_start, chunk.query_len, chunk.context_len) == (1, 6, 9)
        assert chunk.block_table.tolist() == chunk_tables[group]
    assert [r.request_id for r in inputs.sampling_requests] == ["decode", "chunk"]


def test_a_single_group_keeps_the_plain_layout() -> None:
    items = [scheduled("a", 7, 0, 7, ([5, 6],))]
    inputs = prepare_inputs(items, BLOCK_SIZE, CPU, sliding_windows=(None,))
    [layout] = inputs.attn_layouts
    assert layout.sliding_window is None
    assert layout.slot_mapping.tolist() == slots([5, 6], range(7))


def test_a_table_count_that_does_not_match_the_groups_is_refused() -> None:
    items = [scheduled("a", 7, 0, 7, ([5, 6],))]
    with pytest.raises(ValueError, match="one block table per KV cache group"):
        prepare_inputs(items, BLOCK_SIZE, CPU, sliding_windows=(4, None))

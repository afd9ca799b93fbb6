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


def test_a_decode_only_step_gets_the_same_layout_from_its_short_path() -> None:
    """Steps of one new token per request (plain decode) take a path of their own: each
    group's slots, tables (ragged ones padded, cut to the longest row's blocks) and
    lengths, the token ids and the sampled rows as the general path lays them out."""
    items = [
        scheduled("a", 10, 9, 1, ([1, 2, 3], [4, 5, 6])),
        scheduled("b", 6, 5, 1, ([7, 8], [9, 10])),
        # The last token of a prompt that was cut: one new token, and nothing sampled.
        scheduled("c", 8, 3, 1, ([11, 12, 13, 17], [14, 15, 16, 18])),
    ]
    inputs = prepare_inputs(items, BLOCK_SIZE, CPU, sliding_windows=(4, None))
    assert inputs.input_ids.tolist() == [9, 5, 3] and inputs.positions.tolist() == [9, 5, 3]
    assert inputs.logits_indices.tolist() == [0, 1]
    assert [r.request_id for r in inputs.sampling_requests] == ["a", "b"]
    assert inputs.prompt_logprob_rows == () and inputs.spec_token_ids is None
    for group, window in enumerate((4, None)):
        layout = inputs.attn_layouts[group]
        tables = [item.block_ids[group] for item in items]
        assert layout.sliding_window == window and layout.prefills == ()
        assert layout.num_decode_tokens == 3
        assert layout.slot_mapping.tolist() == [
            slot
            for table, p in zip(tables, (9, 5, 3), strict=True)
            for slot in slots(table, range(p, p + 1))
        ]
        assert layout.decode_seq_lens.tolist() == [10, 6, 4]
        # Three blocks hold the longest row's ten tokens; the shorter table is padded.
        assert layout.decode_block_tables.tolist() == [
            tables[0][:3],
            [*tables[1], NULL],
            tables[2][:3],
        ]
        assert layout.decode_block_tables.dtype == torch.long
    # The same requests beside a prefill chunk take the general path: the decode rows'
    # layout is the same there.
    chunk = scheduled("d", 9, 0, 9, ([20, 21, 22], [23, 24, 25]))
    mixed = prepare_inputs([*items, chunk], BLOCK_SIZE, CPU, sliding_windows=(4, None))
    assert mixed.input_ids.tolist()[:3] == inputs.input_ids.tolist()
    for alone, beside in zip(inputs.attn_layouts, mixed.attn_layouts, strict=True):
        assert beside.slot_mapping.tolist()[:3] == alone.slot_mapping.tolist()
        assert torch.equal(beside.decode_block_tables, alone.decode_block_tables)
        assert torch.equal(beside.decode_seq_lens, alone.decode_seq_lens)

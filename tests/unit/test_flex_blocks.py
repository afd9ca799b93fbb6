"""Block tables become the right FlexAttention ``BlockMask``: which pages each query block reads.

Hand-built steps (block size 4): decodes A and B and a chunk D that all hold
page 3 as their first block (a shared prefix), and a fresh prompt C. The
translation alone is checked here, against pages worked out by hand; the
attention it drives is compared with the PyTorch backend in
tests/engine/test_flex_attention.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention import AttentionLayout, PrefillChunk
from kvserve.attention.flex_blocks import build_block_layout, rows_bucket

BLOCK_SIZE = 4
NUM_POOL_BLOCKS = 16


def step() -> AttentionLayout:
    """Decodes A (length 7, pages 3 5) and B (length 9, pages 3 6 7); a fresh 5-token prompt C
    (pages 10 11); a 3-token chunk D after 6 cached tokens (pages 3 12 13)."""
    chunk_c = PrefillChunk(
        query_start=2, query_len=5, context_len=0, block_table=torch.tensor([10, 11])
    )
    chunk_d = PrefillChunk(7, 3, 6, torch.tensor([3, 12, 13]))
    return AttentionLayout(
        slot_mapping=torch.zeros(10, dtype=torch.long),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([[3, 5, 0], [3, 6, 7]]),
        decode_seq_lens=torch.tensor([7, 9]),
        prefills=(chunk_c, chunk_d),
        block_size=BLOCK_SIZE,
    )


def pages_per_block(
    layout_kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor
) -> list[list[int]]:
    return [
        row[:count].tolist() for row, count in zip(kv_indices, layout_kv_num_blocks, strict=True)
    ]


def test_each_query_row_reads_its_own_requests_pages_up_to_its_position() -> None:
    blocks = build_block_layout(step(), 1, NUM_POOL_BLOCKS, width=NUM_POOL_BLOCKS)
    assert blocks.num_rows == 16  # 10 tokens, padded to the first bucket
    assert blocks.rows.tolist() == list(range(10))
    assert (
        pages_per_block(blocks.kv_num_blocks, blocks.kv_indices)
        == [
            [3, 5],  # A at position 6
            [3, 6, 7],  # B at position 8
            [10],
            [10],
            [10],
            [10],
            [10, 11],  # C at positions 0..4
            [3, 12],
            [3, 12],
            [3, 12, 13],  # D at positions 6, 7, 8
        ]
        + [[]] * 6
    )  # padding rows read nothing
    assert blocks.query_positions.tolist() == [6, 8, 0, 1, 2, 3, 4, 6, 7, 8] + [-1] * 6
    logical = {
        page: index for page, index in enumerate(blocks.logical_blocks.tolist()) if index >= 0
    }
    assert logical == {3: 0, 5: 1, 6: 1, 7: 2, 10: 0, 11: 1, 12: 1, 13: 2}


def test_a_sliding_window_drops_the_pages_before_it() -> None:
    windowed = dataclasses.replace(step(), sliding_window=5)
    blocks = build_block_layout(windowed, 1, NUM_POOL_BLOCKS, width=NUM_POOL_BLOCKS)
    # Position 6 sees 2..6 (pages 0-1 of A); 8 sees 4..8 (B's pages 1-2, D's pages 1-2).
    assert pages_per_block(blocks.kv_num_blocks, blocks.kv_indices)[:2] == [[3, 5], [6, 7]]
    assert pages_per_block(blocks.kv_num_blocks, blocks.kv_indices)[9] == [12, 13]
    assert blocks.first_positions.tolist()[:10] == [2, 4, 0, 0, 0, 0, 0, 2, 3, 4]


def test_query_blocks_of_sixteen_rows_hold_one_request_each() -> None:
    blocks = build_block_layout(step(), 16, NUM_POOL_BLOCKS, width=4)
    assert blocks.num_rows == rows_bucket(64) == 64
    assert blocks.rows.tolist() == [0, 16, 32, 33, 34, 35, 36, 48, 49, 50]
    assert pages_per_block(blocks.kv_num_blocks, blocks.kv_indices) == [
        [3, 5],
        [3, 6, 7],
        [10, 11],
        [3, 12, 13],
    ]


def test_the_mask_sees_a_requests_keys_up_to_each_query_and_nothing_on_padding_rows() -> None:
    blocks = build_block_layout(step(), 1, NUM_POOL_BLOCKS, width=NUM_POOL_BLOCKS)
    visible = blocks.mask_mod()
    zero = torch.tensor(0)

    def sees(row: int, page: int, offset: int) -> bool:
        return bool(
            visible(zero, zero, torch.tensor(row), torch.tensor(page * BLOCK_SIZE + offset))
        )

    assert sees(0, 5, 2) and not sees(0, 5, 3)  # A at 6: position 6 yes, 7 no
    assert sees(9, 13, 0) and not sees(8, 13, 0)  # D's position 8: by the query at 8 only
    assert not sees(0, 0, 0)  # the null block is nobody's
    assert not sees(12, 3, 0)  # a padding row sees nothing


def test_too_narrow_kv_indices_and_a_page_at_two_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="width"):
        build_block_layout(step(), 1, NUM_POOL_BLOCKS, width=2)
    clashing = step()
    bad_chunk = PrefillChunk(7, 3, 6, torch.tensor([12, 3, 13]))  # page 3 as block 1
    clashing = AttentionLayout(
        clashing.slot_mapping,
        2,
        clashing.decode_block_tables,
        clashing.decode_seq_lens,
        (clashing.prefills[0], bad_chunk),
        BLOCK_SIZE,
    )
    with pytest.raises(ValueError, match="two different logical"):
        build_block_layout(clashing, 1, NUM_POOL_BLOCKS, width=NUM_POOL_BLOCKS)

"""The CUDA-graph path's buckets and fixed buffers, checked on CPU (the graphs themselves need a GPU).

A bucket pads a decode step with rows that read no key, and a later step's
block layout is copied into the captured buffers in place, at their
addresses, whatever its own number of rows.
"""

from __future__ import annotations

import torch

from kvserve.attention import AttentionLayout
from kvserve.attention.flex_blocks import build_block_layout, copy_layout, padded_rows, rows_bucket
from kvserve.worker.cuda_graphs import decode_buckets

BLOCK_SIZE = 4
NUM_POOL_BLOCKS = 32
Q_BLOCK = 16  # CUDA's query block


def decodes(seq_lens: list[int], tables: list[list[int]]) -> AttentionLayout:
    width = max(map(len, tables))
    return AttentionLayout(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_seq_lens=torch.tensor(seq_lens),
        prefills=(),
        block_size=BLOCK_SIZE,
    )


def bucket_layout(layout: AttentionLayout, bucket: int):  # type: ignore[no-untyped-def]
    num_rows = rows_bucket(bucket * Q_BLOCK)
    return build_block_layout(layout, Q_BLOCK, NUM_POOL_BLOCKS, width=8, num_rows=num_rows)


def test_buckets_double_up_to_max_num_seqs() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(6) == (1, 2, 4, 6)


def test_padding_tokens_land_on_rows_without_keys() -> None:
    layout = bucket_layout(decodes([5, 9, 2], [[3, 4], [5, 6, 7], [8]]), bucket=4)
    padded = padded_rows(layout, num_tokens=3, bucket=4)
    assert padded.rows.tolist() == [0, 16, 32, 48]
    assert padded.query_positions[48].item() == -1  # the padding token's row sees nothing
    assert padded.kv_num_blocks.tolist()[:4] == [2, 3, 1, 0]


def test_a_later_step_is_copied_into_the_captured_buffers_in_place() -> None:
    captured = padded_rows(
        bucket_layout(decodes([5, 9, 2], [[3, 4], [5, 6, 7], [8]]), 4), num_tokens=3, bucket=4
    )
    addresses = [
        t.data_ptr() for t in (captured.rows, captured.kv_indices, captured.logical_blocks)
    ]
    later = bucket_layout(decodes([13, 3], [[10, 11, 12, 13], [14]]), 4)
    copy_layout(captured, later, num_tokens=2, bucket=4)
    assert [
        t.data_ptr() for t in (captured.rows, captured.kv_indices, captured.logical_blocks)
    ] == (addresses)
    assert captured.rows.tolist() == [0, 16, 32, 48]
    assert captured.kv_num_blocks.tolist()[:3] == [4, 1, 0]
    assert captured.kv_indices[0, :4].tolist() == [10, 11, 12, 13]
    assert captured.query_positions[:2].tolist() == [12, -1]
    assert torch.equal(captured.logical_blocks, later.logical_blocks)

"""Cascade decode attention equals plain paged decode, and is used only where it applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention import AttentionLayout, TorchPagedAttention, TorchPagedMetadata
from kvserve.attention.cascade import MIN_CASCADE_PREFIX_LEN, cascade_decode, common_prefix_len

BLOCK_SIZE = 4
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8


def decode_metadata(
    block_tables: list[list[int]], seq_lens: list[int], common_prefix: int, dtype: torch.dtype
) -> TorchPagedMetadata:
    width = max(map(len, block_tables))
    table = torch.tensor([row + [0] * (width - len(row)) for row in block_tables])
    layout = AttentionLayout(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=table,
        decode_seq_lens=torch.tensor(seq_lens),
        prefills=(),
        block_size=BLOCK_SIZE,
    )
    built = TorchPagedAttention().build_group(layout, dtype, num_pool_blocks=40)
    return dataclasses.replace(built, decode_common_prefix_len=common_prefix)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_matches_plain_decode(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kv_cache = torch.randn(2, 40, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    shared = [5, 9, 2, 30]  # 16 shared tokens
    # Tails of different lengths, one ending exactly on a block boundary.
    block_tables = [[*shared, 11], [*shared, 12, 13], [*shared, 14, 15, 16], [*shared, 17]]
    seq_lens = [17, 24, 27, 20]
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    expected = TorchPagedAttention._decode(
        query, kv_cache, decode_metadata(block_tables, seq_lens, 0, dtype), scale
    )
    cascade = decode_metadata(block_tables, seq_lens, 16, dtype)
    actual = cascade_decode(
        query,
        kv_cache,
        cascade.layout.decode_block_tables,
        cascade.decode_mask,
        cascade.decode_common_prefix_len,
        scale,
    )
    assert actual.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_common_prefix_covers_shared_blocks_below_every_rows_length() -> None:
    bs = 16
    shared = list(range(1, 21))  # 20 blocks = 320 tokens
    tables = torch.tensor([[*shared, 100, 101], [*shared, 102, 0], [*shared, 103, 104]])
    assert common_prefix_len(tables, torch.tensor([340, 330, 345]), bs) == 320
    # A row whose own token falls in the last shared block keeps that block out.
    assert common_prefix_len(tables, torch.tensor([340, 320, 345]), bs) == 304
    # One row, or a different first block: nothing to share.
    assert common_prefix_len(tables[:1], torch.tensor([340]), bs) == 0
    other = tables.clone()
    other[1, 0] = 99
    assert common_prefix_len(other, torch.tensor([340, 330, 345]), bs) == 0
    # Too short a prefix is not worth a second pass: 15 shared blocks are 240 tokens.
    assert MIN_CASCADE_PREFIX_LEN > 240
    assert common_prefix_len(tables[:, 5:], torch.tensor([260, 250, 265]), bs) == 0

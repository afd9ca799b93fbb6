"""Decode attention over a request's verification rows, read once for all of them.

A request verifying k proposals is k + 1 decode rows with the same block table and
lengths L, L + 1, ..., L + k. The kernel attends such rows together (their heads as
more query heads of one sequence, each masked past its own length) so each KV block
is read once. Every row must still get exactly its own attention: compared here with
the PyTorch backend (the reference), with NaN in every slot past a group's end, for
groups crossing block edges, split across threads or not, beside rows that go alone,
and with tables or windows that must keep rows apart; and bit for bit the floats the
same row gets attended alone, which keeps greedy output with speculative proposals
token for token the output without them.
"""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import assert_within_bf16_weight_rounding, bf16_paths

from kvserve.attention import AttentionLayout, TorchPagedAttention, TorchPagedMetadata
from kvserve.kernels import NativeOps


def verification_inputs(
    groups: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TorchPagedMetadata]:
    """groups: (first length, rows) per request; each request's rows share one table."""
    lengths = [first + r for first, rows in groups for r in range(rows)]
    width = -(-max(lengths) // block_size)
    kv_cache = torch.randn(2, len(groups) * width + 1, block_size, num_kv_heads, head_dim)
    order = torch.randperm(len(groups) * width) + 1
    tables = []
    for g, (first, rows) in enumerate(groups):
        table = order[g * width : (g + 1) * width].clone()
        table[-(-(first + rows - 1) // block_size) :] = 0  # past the longest row: unused
        tables += [table] * rows
        # Slots past the group's longest row hold garbage no row may read.
        last = table[(first + rows - 2) // block_size]
        kv_cache[:, last, (first + rows - 2) % block_size + 1 :] = float("nan")
    blocks = torch.stack(tables)
    seq_lens = torch.tensor(lengths)
    layout = AttentionLayout(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long),
        num_decode_tokens=len(lengths),
        decode_block_tables=blocks,
        decode_seq_lens=seq_lens,
        prefills=(),
        block_size=block_size,
        sliding_window=window,
    )
    metadata = TorchPagedAttention().build_group(layout, torch.float32, kv_cache.shape[1])
    query = torch.randn(len(lengths), num_heads, head_dim)
    return query, kv_cache, blocks, seq_lens, metadata


def reference(
    query: torch.Tensor, pool: torch.Tensor, metadata: TorchPagedMetadata, scale: float
) -> torch.Tensor:
    # The reference never reads the NaN slots past a row's end: zero them for its gather.
    return TorchPagedAttention._decode(query, torch.nan_to_num(pool.float()), metadata, scale)


@pytest.mark.parametrize(
    "groups",
    [
        [(30, 2)],  # one request, two rows, inside a block
        [(14, 6)],  # six rows across a block edge
        [(1, 17)],  # seventeen rows from the first token
        [(700, 6)],  # long: split across threads
        [(200, 4), (9, 1), (64, 6), (3, 1)],  # requests verifying beside plain decodes
        [(1000, 17), (33, 3)],
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_table_attend_as_alone(
    ops: NativeOps, groups: list[tuple[int, int]], num_threads: int, pool_dtype: torch.dtype
) -> None:
    torch.manual_seed(sum(first * rows for first, rows in groups))
    query, kv_cache, blocks, seq_lens, metadata = verification_inputs(groups, 9, 3, 64, 16)
    pool = kv_cache.to(pool_dtype)
    scale = 64**-0.5
    expected = reference(query, pool, metadata, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for path in bf16_paths(ops) if pool_dtype == torch.bfloat16 else [ops]:
            actual = path.paged_decode(query, pool, blocks, seq_lens, scale)
            assert not actual.isnan().any()
            if path.pool_kind(pool_dtype) == 2:
                # The bf16 dot loops round the query and the weights: held to that bound.
                clean = torch.nan_to_num(pool)
                assert_within_bf16_weight_rounding(actual, query, clean, metadata, scale)
            else:
                torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
            # Each row alone (its own call, its own batch) gives the same floats, bit for
            # bit: with fewer requests than four a thread, a row's keys are split and
            # summed the same way in any batch (with more, each is one part: not compared).
            if len(groups) >= 4 * num_threads:
                continue
            for row in range(len(seq_lens)):
                alone = path.paged_decode(
                    query[row : row + 1],
                    pool,
                    blocks[row : row + 1],
                    seq_lens[row : row + 1],
                    scale,
                )
                assert torch.equal(actual[row : row + 1], alone), row
    finally:
        torch.set_num_threads(threads)


def test_grouped_query_heads_of_several_kv_heads(ops: NativeOps) -> None:
    # Gemma 3 270M's heads (four query heads on one KV head, 256 wide) and a plain MHA.
    for num_heads, num_kv_heads, head_dim in ((4, 1, 256), (4, 4, 32), (8, 2, 40)):
        torch.manual_seed(num_heads * head_dim)
        query, kv_cache, blocks, seq_lens, metadata = verification_inputs(
            [(40, 5), (7, 2)], num_heads, num_kv_heads, head_dim, 8
        )
        actual = ops.paged_decode(query, kv_cache, blocks, seq_lens, 0.3)
        torch.testing.assert_close(
            actual, reference(query, kv_cache, metadata, 0.3), atol=1e-5, rtol=1e-5
        )


def test_rows_of_other_tables_or_windows_stay_apart(ops: NativeOps) -> None:
    """Consecutive lengths with different tables (two requests) are two sequences; rows
    under a sliding window that starts them at different keys are attended alone."""
    torch.manual_seed(11)
    query, kv_cache, blocks, seq_lens, metadata = verification_inputs(
        [(20, 1), (21, 1)], 6, 2, 32, 4
    )
    assert not torch.equal(blocks[0], blocks[1])
    actual = ops.paged_decode(query, kv_cache, blocks, seq_lens, 0.2)
    torch.testing.assert_close(
        actual, reference(query, kv_cache, metadata, 0.2), atol=1e-5, rtol=1e-5
    )
    query, kv_cache, blocks, seq_lens, metadata = verification_inputs(
        [(60, 5)], 6, 2, 32, 4, window=16
    )
    actual = ops.paged_decode(query, kv_cache, blocks, seq_lens, 0.2, sliding_window=16)
    torch.testing.assert_close(
        actual, reference(query, kv_cache, metadata, 0.2), atol=1e-5, rtol=1e-5
    )

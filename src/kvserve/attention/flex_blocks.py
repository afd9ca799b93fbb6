"""A step's block tables as a FlexAttention ``BlockMask`` over the whole page pool.

FlexAttention sees the flat batch as one query sequence and the KV pool as
one key sequence of ``num_pool_blocks * block_size`` slots (K/V viewed in
place, never gathered). The ``BlockMask`` says which pool pages each block of
query rows reads (``kv_indices``, physical page ids); the ``mask_mod`` says,
inside those pages, which slots each query sees.

Query blocks never mix requests: each request's query tokens start a fresh
block of ``q_block_size`` rows in the *attention layout* (``rows`` maps each
flat token to its row; the rows left over are padding, with no keys). With
``q_block_size`` 1 (CPU) the layout is the flat batch itself. So a block's
pages are the slice of one block table that its queries can reach: from the
block of the first key the first query's window reaches to the block of the
last query's position. No page appears twice in a block, and no page of
another request is listed.

Inside a page the ``mask_mod`` needs the key's position, i.e. the page's
logical index. A page stands at the same logical index in every table that
holds it in a step (prefix-cache hashes are chained from the start of the
sequence, so a shared block is always the same block of its prefix), so one
``[num_pool_blocks]`` table maps pages to logical indices; the builder checks
that invariant and raises when a table breaks it. A query at position p
with first visible position f sees key position k when ``f <= k <= p``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from kvserve.attention.metadata import AttentionLayout
from kvserve.core.block_pool import NULL_BLOCK_ID

# Rows of the attention layout come in buckets (x4 apart, from 16) so that a
# compiled kernel serves every step whose rows fit: padding rows have no keys
# and cost next to nothing, and few buckets mean few compiles.
MIN_ROWS_BUCKET = 16
ROWS_BUCKET_GROWTH = 4
# The per-row (decode) form's mask has one query block per row; the decoding kernel
# pads a row's query heads to tiles of 16 (``BLOCK_M``), which must divide the block.
PER_ROW_Q_BLOCK = 16


def rows_bucket(num_rows: int, smallest: int = MIN_ROWS_BUCKET) -> int:
    """The smallest bucket (``smallest``, x4, x16, ...: 16, 64, 256, ... by default) that
    holds ``num_rows`` attention rows."""
    bucket = smallest
    while bucket < num_rows:
        bucket *= ROWS_BUCKET_GROWTH
    return bucket


@dataclass(frozen=True)
class FlexBlockLayout:
    """One step's FlexAttention view of one KV cache group, for one sliding window.

    rows: ``[T]`` long; the attention-layout row of each flat-batch token.
    query_positions: ``[R]`` int32; the position of each row's query, -1 on padding rows.
    first_positions: ``[R]`` int32; the first key position each row sees (0 without a window).
    kv_num_blocks: ``[R / q_block_size]`` int32; pages each query block reads.
    kv_indices: ``[R / q_block_size, width]`` int32; those pages (physical ids)
        first, in logical order; entries past ``kv_num_blocks`` are never read.
    logical_blocks: ``[num_pool_blocks]`` int32; each page's logical index in
        this step's tables, -1 for a page no table holds (and the null block).
    q_block_size, block_size: query rows per query block; tokens per page.
    """

    rows: torch.Tensor
    query_positions: torch.Tensor
    first_positions: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    logical_blocks: torch.Tensor
    q_block_size: int
    block_size: int

    @property
    def num_rows(self) -> int:
        return int(self.query_positions.shape[0])

    @property
    def num_pool_blocks(self) -> int:
        return int(self.logical_blocks.shape[0])

    def mask_mod(self, per_row: bool = False) -> Callable[..., torch.Tensor]:
        """FlexAttention's ``mask_mod``: may attention row ``q_idx`` (``per_row``: the row
        is the batch index ``b``) see pool slot ``kv_idx``?"""
        logical_blocks, block_size = self.logical_blocks, self.block_size
        query_positions, first_positions = self.query_positions, self.first_positions

        def visible(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            row = b if per_row else q_idx
            logical = logical_blocks[kv_idx // block_size]
            key_position = logical * block_size + kv_idx % block_size
            return (
                (logical >= 0)
                & (key_position <= query_positions[row])
                & (key_position >= first_positions[row])
            )

        return visible

    def block_mask(self, per_row: bool = False) -> BlockMask:
        """The ``BlockMask`` over a pool of ``len(logical_blocks)`` pages (no backward info).

        By default the rows are one query sequence in blocks of ``q_block_size``.
        ``per_row`` (the decode form; needs ``q_block_size`` 1): each row is its own
        batch entry holding one query, so FlexAttention's decoding kernel, which splits
        a row's keys across programs and reads each KV head once for the query heads
        that share it, takes the step.
        """
        num_keys = self.num_pool_blocks * self.block_size
        if not per_row:
            return BlockMask.from_kv_blocks(
                self.kv_num_blocks[None, None],
                self.kv_indices[None, None],
                BLOCK_SIZE=(self.q_block_size, self.block_size),
                mask_mod=self.mask_mod(),
                seq_lengths=(self.num_rows, num_keys),
                compute_q_blocks=False,
            )
        if self.q_block_size != 1:
            raise ValueError(f"the per-row form needs q_block_size 1, not {self.q_block_size}")
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[:, None, None],
            self.kv_indices[:, None, None],
            BLOCK_SIZE=(PER_ROW_Q_BLOCK, self.block_size),
            mask_mod=self.mask_mod(per_row=True),
            seq_lengths=(1, num_keys),
            compute_q_blocks=False,
        )


def build_block_layout(
    layout: AttentionLayout,
    q_block_size: int,
    num_pool_blocks: int,
    width: int,
    num_rows: int | None = None,
) -> FlexBlockLayout:
    """Translate ``layout``'s block tables into a :class:`FlexBlockLayout` for its window.

    q_block_size: query
    rows per block; num_pool_blocks: pages in the pool; width: columns of
    ``kv_indices`` (at least the most pages one query block reads); num_rows:
    attention rows (default: the bucket of what the step needs). Raises
    ValueError when the step does not fit ``width`` or ``num_rows``, or a page
    sits at two logical indices.
    """
    block_size, sliding_window = layout.block_size, layout.sliding_window
    tables, context_lens, query_lens = _request_tables(layout)
    num_requests = len(query_lens)
    padded = -(-query_lens // q_block_size) * q_block_size
    row_start = np.cumsum(padded) - padded
    needed_rows = int(padded.sum())
    num_rows = rows_bucket(needed_rows) if num_rows is None else num_rows
    if num_rows < needed_rows or num_rows % q_block_size:
        raise ValueError(
            f"num_rows {num_rows} must be a multiple of {q_block_size} and hold {needed_rows} rows"
        )

    # Flat token i of request r is its (i - query_start[r])-th query, at row row_start[r] + that.
    request_of_token = np.repeat(np.arange(num_requests), query_lens)
    query_start = np.cumsum(query_lens) - query_lens
    index_in_request = np.arange(int(query_lens.sum())) - query_start[request_of_token]
    rows = row_start[request_of_token] + index_in_request
    query_positions = np.full(num_rows, -1, dtype=np.int64)
    query_positions[rows] = context_lens[request_of_token] + index_in_request
    first_positions = np.zeros(num_rows, dtype=np.int64)
    if sliding_window is not None:
        first_positions[rows] = np.maximum(0, query_positions[rows] - sliding_window + 1)

    # Query block b: its request, its first and last query positions, its pages' range.
    num_blocks = num_rows // q_block_size
    used_blocks = needed_rows // q_block_size
    block_request = np.repeat(np.arange(num_requests), padded // q_block_size)
    block_first_row = np.arange(used_blocks) * q_block_size
    first_query = context_lens[block_request] + block_first_row - row_start[block_request]
    last_query = np.minimum(
        first_query + q_block_size - 1,
        context_lens[block_request] + query_lens[block_request] - 1,
    )
    first_page = first_positions[block_first_row] // block_size
    counts = last_query // block_size - first_page + 1
    most = int(counts.max()) if used_blocks else 0
    if most > width:
        raise ValueError(f"a query block reads {most} pages, more than kv_indices' width {width}")
    columns = first_page[:, None] + np.arange(most)[None, :]
    pages = tables[block_request[:, None], np.minimum(columns, tables.shape[1] - 1)]
    kv_indices = np.zeros((num_blocks, width), dtype=np.int32)
    kv_indices[:used_blocks, :most] = np.where(np.arange(most)[None, :] < counts[:, None], pages, 0)
    kv_num_blocks = np.zeros(num_blocks, dtype=np.int32)
    kv_num_blocks[:used_blocks] = counts

    logical_blocks = _logical_blocks(tables, context_lens + query_lens, block_size, num_pool_blocks)
    device = layout.slot_mapping.device
    return FlexBlockLayout(
        rows=torch.from_numpy(rows).to(device),
        query_positions=torch.from_numpy(query_positions.astype(np.int32)).to(device),
        first_positions=torch.from_numpy(first_positions.astype(np.int32)).to(device),
        kv_num_blocks=torch.from_numpy(kv_num_blocks).to(device),
        kv_indices=torch.from_numpy(kv_indices).to(device),
        logical_blocks=torch.from_numpy(logical_blocks).to(device),
        q_block_size=q_block_size,
        block_size=block_size,
    )


def _request_tables(layout: AttentionLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per decode row, then per prefill chunk, in flat order: block tables ``[R, W]``
    (null-padded; a verifying request's decode rows repeat its table), context and
    query lengths."""
    decode_tables = layout.decode_block_tables.cpu().numpy()
    decode_seq_lens = layout.decode_seq_lens.cpu().numpy().astype(np.int64)
    chunk_tables = [chunk.block_table.cpu().numpy() for chunk in layout.prefills]
    width = max([decode_tables.shape[1], *(len(t) for t in chunk_tables)], default=1)
    tables = np.full((len(decode_seq_lens) + len(chunk_tables), max(width, 1)), NULL_BLOCK_ID)
    tables[: len(decode_seq_lens), : decode_tables.shape[1]] = decode_tables
    for row, table in enumerate(chunk_tables, start=len(decode_seq_lens)):
        tables[row, : len(table)] = table
    context_lens = np.concatenate(
        [decode_seq_lens - 1, [c.context_len for c in layout.prefills]]
    ).astype(np.int64)
    query_lens = np.concatenate(
        [np.ones(len(decode_seq_lens)), [c.query_len for c in layout.prefills]]
    ).astype(np.int64)
    return tables, context_lens, query_lens


def _logical_blocks(
    tables: np.ndarray, seq_lens: np.ndarray, block_size: int, num_pool_blocks: int
) -> np.ndarray:
    """``[num_pool_blocks]`` int32: each page's logical index in ``tables``, -1 if none."""
    columns = np.arange(tables.shape[1])[None, :]
    held = (columns < -(-seq_lens // block_size)[:, None]) & (tables != NULL_BLOCK_ID)
    pages, logical = tables[held], np.broadcast_to(columns, tables.shape)[held]
    if pages.size and (pages.min() < 0 or pages.max() >= num_pool_blocks):
        raise IndexError(f"block ids must lie in [0, {num_pool_blocks}), got {pages.max()}")
    logical_blocks = np.full(num_pool_blocks, -1, dtype=np.int32)
    logical_blocks[pages] = logical
    if not np.array_equal(logical_blocks[pages], logical):
        raise ValueError("a KV block sits at two different logical indices in one step")
    return logical_blocks


# A CUDA graph reads a bucket's block layout at fixed addresses: the layout it was
# captured with is padded to the bucket's token count, and each later step's layout
# (same attention rows and pool, fewer tokens maybe) is copied into it in place.


def padded_rows(layout: FlexBlockLayout, num_tokens: int, bucket: int) -> FlexBlockLayout:
    """``layout`` (of ``num_tokens`` decode rows) with ``rows`` for ``bucket`` tokens: padding
    token i reads attention row ``i * q_block_size``, a row with no keys (the step's rows
    end before it)."""
    padding = torch.arange(num_tokens, bucket, device=layout.rows.device) * layout.q_block_size
    return dataclasses.replace(layout, rows=torch.cat([layout.rows, padding]))


def copy_layout(
    static: FlexBlockLayout, new: FlexBlockLayout, num_tokens: int, bucket: int
) -> None:
    """Write a step's block layout (``num_tokens`` decode rows) into a captured one of
    ``bucket`` tokens, in place (same shapes but ``rows``, which is padded here)."""
    static.rows.copy_(padded_rows(new, num_tokens, bucket).rows)
    for name in (
        "query_positions",
        "first_positions",
        "kv_num_blocks",
        "kv_indices",
        "logical_blocks",
    ):
        getattr(static, name).copy_(getattr(new, name))

"""Turn a step's schedule into the flat tensors of one forward pass.

Requests with a single new token (decodes, or the last token of a prompt) go
first, then prefill chunks; within each group the scheduler's order is kept.
The per-token arrays (positions, slot mapping) are computed with numpy in one
go; the only Python loop is over requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention import AttentionMetadata, PrefillChunk
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.request import Request
from kvserve.core.scheduler import ScheduledRequest


@dataclass(frozen=True)
class ModelInputs:
    """Everything one forward pass and its sampling need.

    input_ids, positions: ``[num_tokens]`` long.
    logits_indices: ``[num_sampling]`` long; the flat-batch rows whose hidden
        states go through the LM head, in the order of ``sampling_requests``.
    scheduled: the step's requests in flat-batch order (single-token ones first).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    scheduled: list[ScheduledRequest]


def prepare_inputs(
    scheduled: Sequence[ScheduledRequest], block_size: int, device: torch.device
) -> ModelInputs:
    """Build the model inputs for ``scheduled`` (which must not be empty).

    The attention layout is the one every backend shares; the runner has the
    backend add what it needs (``AttentionBackend.build_metadata``).
    """
    items = [s for s in scheduled if s.num_new_tokens == 1] + [
        s for s in scheduled if s.num_new_tokens > 1
    ]
    num_decodes = len(items) - sum(1 for s in items if s.num_new_tokens > 1)
    num_new = np.array([s.num_new_tokens for s in items], dtype=np.int64)
    context_lens = np.array([s.request.num_computed_tokens for s in items], dtype=np.int64)
    query_end = np.cumsum(num_new)
    query_start = query_end - num_new
    num_tokens = int(query_end[-1])

    # Token i of request r sits at position context_lens[r] + (i - query_start[r]).
    row_of_token = np.repeat(np.arange(len(items)), num_new)
    positions = np.arange(num_tokens) - query_start[row_of_token] + context_lens[row_of_token]

    max_blocks = max(len(s.block_ids) for s in items)
    block_tables = np.full((len(items), max_blocks), NULL_BLOCK_ID, dtype=np.int64)
    input_ids: list[int] = []
    for row, item in enumerate(items):
        block_tables[row, : len(item.block_ids)] = item.block_ids
        start = item.request.num_computed_tokens
        input_ids.extend(item.request.all_token_ids[start : start + item.num_new_tokens])
    slot_mapping = (
        block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    )

    block_tables_t = torch.from_numpy(block_tables).to(device)
    seq_lens = context_lens + num_new
    prefills = tuple(
        PrefillChunk(
            query_start=int(query_start[row]),
            query_len=int(num_new[row]),
            context_len=int(context_lens[row]),
            block_table=block_tables_t[row, : -(-int(seq_lens[row]) // block_size)],
        )
        for row in range(num_decodes, len(items))
    )
    # Decodes attend over a rectangle of whole blocks, as wide as the longest of them.
    decode_seq_lens = seq_lens[:num_decodes]
    num_decode_blocks = -(-int(decode_seq_lens.max()) // block_size) if num_decodes else 0
    attn_metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_decode_tokens=num_decodes,
        decode_block_tables=block_tables_t[:num_decodes, :num_decode_blocks],
        decode_seq_lens=torch.from_numpy(decode_seq_lens).to(device),
        prefills=prefills,
        block_size=block_size,
    )
    sampling_rows = [row for row, item in enumerate(items) if item.samples]
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=attn_metadata,
        logits_indices=torch.from_numpy(query_end[sampling_rows] - 1).to(device),
        sampling_requests=[items[row].request for row in sampling_rows],
        scheduled=items,
    )

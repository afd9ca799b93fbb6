"""Which keys each query of a step may see, as additive masks (0 or -inf).

Decode rows attend over a rectangle of whole blocks, so their masks hide the
padding past each row's length; prefill chunks that do not start their
sequence see the cached context before them. A sliding window hides, in
addition, every key more than ``window - 1`` positions behind the query.
"""

from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionLayout, PrefillChunk


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive mask attention uses: 0 or -inf."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def decode_mask(layout: AttentionLayout, dtype: torch.dtype) -> torch.Tensor:
    """``[num_decodes, 1, 1, num_slots]``: each row's keys (within the layout's window) visible."""
    kv_slots = layout.decode_block_tables.shape[1] * layout.block_size
    seq_lens = layout.decode_seq_lens
    slots = torch.arange(kv_slots, device=seq_lens.device)
    visible = slots[None, :] < seq_lens[:, None]
    window = layout.sliding_window
    if window is not None:
        visible &= slots[None, :] >= (seq_lens - window)[:, None]
    return additive(visible, dtype)[:, None, None, :]


def first_key(chunk: PrefillChunk, window: int | None, block_size: int) -> int:
    """The first position (on a block edge) a chunk's queries can see under ``window``."""
    if window is None:
        return 0
    return max(0, chunk.context_len - window + 1) // block_size * block_size


def chunk_mask(
    chunk: PrefillChunk, dtype: torch.dtype, window: int | None = None, block_size: int = 1
) -> torch.Tensor | None:
    """``[query_len, seq_len - first_key]``: which keys (from ``first_key`` on) each query sees.

    None when plain causal attention over the chunk alone is the answer: a
    chunk that starts the sequence and that no window cuts.
    """
    if chunk.context_len == 0 and (window is None or chunk.seq_len <= window):
        return None
    device = chunk.block_table.device
    query_pos = torch.arange(chunk.context_len, chunk.seq_len, device=device)
    key_pos = torch.arange(first_key(chunk, window, block_size), chunk.seq_len, device=device)
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    return additive(visible, dtype)

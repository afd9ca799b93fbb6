"""What attention needs to know about one flat batch of tokens.

The flat batch holds every scheduled token of the step, request after request,
with no padding. Requests that contribute a single query token (decodes, or a
prompt's last token) come first; prefill chunks follow. The model passes this
object explicitly to every layer: there is no global context.

``AttentionMetadata`` is the layout every backend shares, built by the worker.
Once per step the backend turns it into what it needs on top
(``AttentionBackend.build_metadata``: masks, cascade decisions), so nothing
backend-specific is built for a backend that does not use it.

A model with several KV cache groups (sliding-window and global layers; see
``core/kv_cache_groups.py``) gets one layout per group, each with its own
slot mapping and block tables, gathered in the top-level object's
``groups``; every attention layer reads the one of its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """A run of consecutive query tokens of one request.

    query_start: index of the chunk's first token in the flat batch.
    query_len: tokens in the chunk (>= 2).
    context_len: tokens of the request computed before this chunk; the chunk
        occupies positions ``context_len .. context_len + query_len - 1``.
    block_table: ``[num_blocks]`` block ids covering positions
        ``0 .. context_len + query_len - 1``.
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention layout, shared by every layer (built once per step).

    slot_mapping: ``[num_tokens]`` long; the flat KV slot (``block_id *
        block_size + offset``) each token's K/V is written to.
    num_decode_tokens: the first ``num_decode_tokens`` tokens each belong to a
        different request and have one query each.
    decode_block_tables: ``[num_decode_tokens, num_blocks]`` long, just wide
        enough for the longest of them, padded with the null block.
    decode_seq_lens: ``[num_decode_tokens]`` long; each decode row's sequence
        length, its new token included.
    prefills: the prefill chunks, in flat-batch order after the decodes.
    block_size: tokens per KV block.
    sliding_window: the window of the layers that read this layout (a query at
        position p sees keys ``p - sliding_window < k <= p``); None for global
        attention. Block-table entries wholly before a window may be the null block.
    groups: with several KV cache groups, each group's layout in group order
        (this object is then the first group's, with ``groups`` set); empty
        for a model with one group.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: tuple[PrefillChunk, ...]
    block_size: int
    sliding_window: int | None = None
    groups: tuple[AttentionMetadata, ...] = ()

    def for_group(self, kv_group: int) -> AttentionMetadata:
        """The layout of KV cache group ``kv_group`` (this one when there are no groups)."""
        return self.groups[kv_group] if self.groups else self

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

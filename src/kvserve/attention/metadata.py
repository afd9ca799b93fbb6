"""What attention needs to know about one flat batch of tokens.

The flat batch holds every scheduled token of the step, request after request,
with no padding. Decode rows come first: requests that contribute a single
query token (decodes, or a prompt's last token), then requests verifying
speculative proposals, one row per token; prefill chunks follow.

Two levels, each built once per step:

- :class:`AttentionLayout`: one KV cache group's view of the flat batch (its
  slot mapping, block tables and sliding window), built by the worker
  (``worker/input_batch.py``), the same for every backend. A model with
  several KV cache groups (sliding-window and global layers; see
  ``core/kv_cache_groups.py``) gets one layout per group; the groups list the
  same requests and differ only in slot mapping, block tables and window.
- :class:`AttentionMetadata`: what the model receives and passes explicitly to
  every layer (there is no global context): one entry per KV cache group,
  each what the backend built for that group's layout up front
  (``AttentionBackend.build_metadata``: masks, cascade decisions, block
  masks), holding the layout it was built from. Every attention layer reads
  the entry of its group; nothing in it is filled later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

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
class AttentionLayout:
    """One KV cache group's view of a step's flat batch (built once per step).

    slot_mapping: ``[num_tokens]`` long; the flat KV slot (``block_id *
        block_size + offset``) each token's K/V is written to.
    num_decode_tokens: the first ``num_decode_tokens`` tokens are decode rows,
        one query each. Several consecutive rows may belong to one request (its
        last known token, then the proposals it verifies): they share its block
        table and differ in length, so each sees the keys up to its own position
        (the step writes every row's K/V before attending, so a row reads the
        rows before it from the pool).
    decode_block_tables: ``[num_decode_tokens, num_blocks]`` long, one row per
        decode row (repeated for a request's rows), just wide enough for the
        longest of them, padded with the null block.
    decode_seq_lens: ``[num_decode_tokens]`` long; each decode row's sequence
        length: its position + 1.
    prefills: the prefill chunks, in flat-batch order after the decodes.
    block_size: tokens per KV block.
    sliding_window: the window of the group's layers (a query at position p
        sees keys ``p - sliding_window < k <= p``); None for global attention.
        Block-table entries wholly before a window may be the null block. The
        one place a step states the window: backends read it here.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: tuple[PrefillChunk, ...]
    block_size: int
    sliding_window: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class GroupMetadata(Protocol):
    """What a backend built for one KV cache group: its own fields beside the group's layout."""

    @property
    def layout(self) -> AttentionLayout: ...


GroupMetadataT = TypeVar("GroupMetadataT", bound=GroupMetadata)


@dataclass(frozen=True)
class AttentionMetadata(Generic[GroupMetadataT]):
    """A step's attention metadata: what one backend built, per KV cache group.

    groups: one entry per KV cache group, in group order (a model with one
        attention type has one); the layer bound to group ``g`` reads ``groups[g]``.
    """

    groups: tuple[GroupMetadataT, ...]

"""What attention needs to know about one flat batch of tokens.

The flat batch holds every scheduled token of the step, request after request,
with no padding. Requests that contribute a single query token (decodes, or a
prompt's last token) come first; prefill chunks follow. The model passes this
object explicitly to every layer: there is no global context.
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
    mask: ``[query_len, seq_len]`` additive mask in the model's dtype, 0 where
        query i may see key j (``j <= context_len + i``) and -inf elsewhere;
        None when context_len is 0 and the chunk is plainly causal.
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None

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
    decode_mask: ``[num_decode_tokens, 1, 1, num_blocks * block_size]``
        additive mask in the model's dtype: 0 for the slots that hold the
        request's keys, -inf for padding.
    prefills: the prefill chunks, in flat-batch order after the decodes.
    decode_common_prefix_len: the first this-many positions of every decode
        row sit in the same blocks (a prefix-cache hit they share), so a
        backend may attend to them once for all rows. A multiple of the block
        size, below every row's length; 0 when there is none worth using.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_mask: torch.Tensor
    prefills: tuple[PrefillChunk, ...]
    decode_common_prefix_len: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

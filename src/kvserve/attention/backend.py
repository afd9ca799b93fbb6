"""The interface every attention implementation provides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic

import torch

from kvserve.attention.metadata import AttentionLayout, AttentionMetadata, GroupMetadataT


class AttentionBackend(ABC, Generic[GroupMetadataT]):
    """Writes a step's K/V into the paged cache and attends over it.

    The KV cache of one layer is a tensor ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]`` (index 0 holds K, 1 holds V). Backends may
    differ in speed, never in results beyond floating-point rounding.

    Once per step the runner has the backend build its metadata for every KV
    cache group (:meth:`build_metadata`); each layer then attends with its
    group's entry (:meth:`forward`). A backend whose steps can be captured in
    CUDA graphs also implements :meth:`capture_metadata` and
    :meth:`copy_for_replay`.
    """

    name: str

    def build_metadata(
        self, layouts: Sequence[AttentionLayout], dtype: torch.dtype, num_pool_blocks: int
    ) -> AttentionMetadata[GroupMetadataT]:
        """What every layer of a step reads, built once: one entry per KV cache group.

        layouts: each group's layout, in group order; dtype: the activations';
        num_pool_blocks: pages in the KV pool.
        """
        return AttentionMetadata(
            tuple(self.build_group(layout, dtype, num_pool_blocks) for layout in layouts)
        )

    @abstractmethod
    def build_group(
        self, layout: AttentionLayout, dtype: torch.dtype, num_pool_blocks: int
    ) -> GroupMetadataT:
        """This backend's metadata for one group's layout (which it holds), for the
        group's sliding window; nothing in it is built later."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: GroupMetadataT,
        scale: float,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention for one layer of the group ``metadata`` was built for.

        query: ``[num_tokens, num_heads, head_dim]``; key, value:
        ``[num_tokens, num_kv_heads, head_dim]``. Returns ``[num_tokens,
        num_heads, head_dim]``. Each token attends causally to its own
        request's tokens only; with the layout's ``sliding_window``, to the
        last ``sliding_window`` of them (itself included): a query at position
        p sees keys at ``p - sliding_window < k <= p``, and the block-table
        entries wholly before that may hold the null block. ``soft_cap``:
        scaled scores become ``soft_cap * tanh(score / soft_cap)`` before the
        mask and the softmax (Gemma 2).
        """

    # Capture hooks for CUDA graphs (worker/cuda_graphs.py). A graph reads and writes
    # fixed addresses, so the metadata a captured forward pass reads must live in
    # buffers that later steps overwrite in place.

    def capture_metadata(
        self, layouts: Sequence[AttentionLayout], num_rows: int, num_pool_blocks: int
    ) -> AttentionMetadata[GroupMetadataT]:
        """Metadata for a graph of decode-only steps of ``num_rows`` rows, over buffers
        allocated here that the graph will read at their addresses.

        layouts: a decode-only step of at most ``num_rows`` rows, each group's;
        its values fill the buffers. The rows past the step's are padding:
        their K/V go to slot 0 (of the null block, never read) and they see no
        key. The same metadata serves every later step of this row count
        through :meth:`copy_for_replay`.
        """
        raise NotImplementedError(f"{self.name} attention is not captured in CUDA graphs")

    def copy_for_replay(
        self, captured: AttentionMetadata[GroupMetadataT], layouts: Sequence[AttentionLayout]
    ) -> None:
        """Before a replay: write a decode-only step's ``layouts`` (at most the captured
        row count) into ``captured``'s buffers in place, and pad the rows past them."""
        raise NotImplementedError(f"{self.name} attention is not captured in CUDA graphs")


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store K/V of the flat batch at their slots: ``kv_cache[:, slot] = (k, v)``.

    A pool narrower than the activations (bfloat16 under float32) stores them rounded.
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    pool_dtype = kv_cache.dtype
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(pool_dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(pool_dtype))

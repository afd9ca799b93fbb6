"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step at small batch sizes on a GPU is mostly kernel launches: one
per operator per layer, each a few microseconds of CPU time for a few
microseconds of GPU work. A CUDA graph records the whole forward pass once
and replays it in one launch. A graph reads and writes fixed addresses, so
every input lives in a buffer allocated once (token ids, positions, each KV
cache group's slot mapping, and the FlexAttention block layout of each
bucket); a step copies its values into them, pads the rest, and replays.

Padding rows are decode rows with token 0 at position 0 whose K/V go to slot
0 of the null block (which FlexAttention never reads) and whose attention
rows see no key. A decode-only step with more rows than the largest bucket,
or any step with a prefill chunk, runs eagerly.

Each bucket is captured the first time a step needs it (after one eager run
that compiles FlexAttention for its shapes). Only FlexAttention is captured:
its per-step metadata is the block layout copied into the fixed buffers.

Unverified on hardware: written and reviewed without a GPU (docs/cuda.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention import AttentionMetadata, FlexAttention, FlexMetadata
from kvserve.attention.flex_blocks import FlexBlockLayout, rows_bucket


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, ... below ``max_num_seqs``, and ``max_num_seqs``."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_seqs)


@dataclass
class _Graph:
    """One captured bucket: its graph, its metadata (over the fixed buffers), its output."""

    graph: torch.cuda.CUDAGraph
    metadata: AttentionMetadata
    layouts: list[FlexBlockLayout]
    hidden: torch.Tensor


class DecodeGraphs:
    """Captures and replays decode-only steps of ``model`` (its attention: ``backend``).

    The CUDA plan's ``DecodeFastPath`` (``worker/platform/cuda.py``).

    windows: each KV cache group's sliding window, in group order;
    num_pool_blocks: pages in the KV pool.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: FlexAttention,
        windows: tuple[int | None, ...],
        num_pool_blocks: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.windows = windows
        self.num_pool_blocks = num_pool_blocks
        self.buckets = decode_buckets(max_num_seqs)
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mappings = [
            torch.zeros(largest, dtype=torch.long, device=device) for _ in windows
        ]
        self.graphs: dict[int, _Graph] = {}
        self.memory_pool = torch.cuda.graph_pool_handle()

    def applies(self, layout: AttentionMetadata) -> bool:
        """A decode-only step that fits the largest bucket."""
        return not layout.prefills and layout.num_decode_tokens <= self.buckets[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` of a decode-only step, by graph replay."""
        num_tokens = int(input_ids.shape[0])
        bucket = next(size for size in self.buckets if size >= num_tokens)
        groups = layout.groups or (layout,)
        fresh = [self._layout(group, bucket) for group in groups]
        self._fill(input_ids, positions, groups, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            captured = self.graphs[bucket] = self._capture(bucket, groups, fresh)
        else:
            for static, new in zip(captured.layouts, fresh, strict=True):
                _copy_layout(static, new, num_tokens, bucket)
        self._replay(captured)
        return captured.hidden[:num_tokens]

    def _replay(self, captured: _Graph) -> None:
        """Run a captured bucket over what its buffers hold now."""
        captured.graph.replay()

    def _layout(self, group: AttentionMetadata, bucket: int) -> FlexBlockLayout:
        """The group's block layout with the attention rows of ``bucket`` decode rows."""
        num_rows = rows_bucket(bucket * self.backend.q_block_size)
        md = self.backend.build_metadata(group, torch.float32)
        return self.backend.prepare(md, group.sliding_window, self.num_pool_blocks, num_rows)[0]

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        groups: tuple[AttentionMetadata, ...],
        bucket: int,
    ) -> None:
        """Copy the step's inputs into the fixed buffers; padding rows get token 0, slot 0."""
        num_tokens = int(input_ids.shape[0])
        for static, new in ((self.input_ids, input_ids), (self.positions, positions)):
            static[:num_tokens].copy_(new)
            static[num_tokens:bucket].zero_()
        for static, group in zip(self.slot_mappings, groups, strict=True):
            static[:num_tokens].copy_(group.slot_mapping)
            static[num_tokens:bucket].zero_()

    def _capture(
        self, bucket: int, groups: tuple[AttentionMetadata, ...], fresh: list[FlexBlockLayout]
    ) -> _Graph:
        """Warm up (compiling FlexAttention for these shapes), then record the forward pass."""
        num_tokens = int(fresh[0].rows.shape[0])
        layouts = [_padded_rows(layout, num_tokens, bucket) for layout in fresh]
        built = []
        for group, layout, slots in zip(groups, layouts, self.slot_mappings, strict=True):
            md = FlexMetadata(
                **{
                    f.name: getattr(group, f.name)
                    for f in dataclasses.fields(AttentionMetadata)
                    if f.name != "groups"
                }
            )
            md = dataclasses.replace(md, slot_mapping=slots[:bucket], num_decode_tokens=bucket)
            md.built[group.sliding_window] = (layout, layout.block_mask())
            built.append(md)
        metadata: AttentionMetadata = built[0]
        if len(built) > 1:
            metadata = dataclasses.replace(built[0], groups=tuple(built))
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(ids, positions, metadata)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            hidden = self.model(ids, positions, metadata)
        return _Graph(graph, metadata, layouts, hidden)


def _padded_rows(layout: FlexBlockLayout, num_tokens: int, bucket: int) -> FlexBlockLayout:
    """``layout`` with ``rows`` for ``bucket`` tokens: padding token i reads attention row
    ``i * q_block_size``, a row with no keys (the step's rows end before it)."""
    padding = torch.arange(num_tokens, bucket, device=layout.rows.device) * layout.q_block_size
    return dataclasses.replace(layout, rows=torch.cat([layout.rows, padding]))


def _copy_layout(
    static: FlexBlockLayout, new: FlexBlockLayout, num_tokens: int, bucket: int
) -> None:
    """Write a step's block layout into a captured bucket's buffers (same shapes but ``rows``)."""
    static.rows.copy_(_padded_rows(new, num_tokens, bucket).rows)
    for name in (
        "query_positions",
        "first_positions",
        "kv_num_blocks",
        "kv_indices",
        "logical_blocks",
    ):
        getattr(static, name).copy_(getattr(new, name))

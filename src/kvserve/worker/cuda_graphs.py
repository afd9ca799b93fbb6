"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step at small batch sizes on a GPU is mostly kernel launches: one
per operator per layer, each a few microseconds of CPU time for a few
microseconds of GPU work. A CUDA graph records the whole forward pass once
and replays it in one launch. A graph reads and writes fixed addresses, so
every input lives in a buffer allocated once: token ids and positions here,
and the attention metadata of each bucket (each KV cache group's slot
mapping, FlexAttention's block layout) in buffers the attention backend
allocates and fills through its capture hooks
(``AttentionBackend.capture_metadata``, ``copy_for_replay``); a step copies
its values into them, pads the rest, and replays.

Padding rows are decode rows with token 0 at position 0 whose K/V go to slot
0 of the null block (which attention never reads) and which see no key. A
decode-only step with more rows than the largest bucket, or any step with a
prefill chunk, runs eagerly. Buckets count rows, not requests: a request
verifying k speculative proposals is ``1 + k`` decode rows, so a full batch
of verifying requests may outgrow the largest bucket and run eagerly.

Each bucket is captured the first time a step needs it (after one eager run
that compiles attention for its shapes). Only FlexAttention implements the
capture hooks.

Run on an H200 by the GPU check: replays give the eager tokens (docs/cuda.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionLayout, AttentionMetadata


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
    """One captured bucket: its graph, its attention metadata (over the backend's fixed
    buffers), its output."""

    graph: torch.cuda.CUDAGraph
    metadata: AttentionMetadata
    hidden: torch.Tensor


class DecodeGraphs:
    """Captures and replays decode-only steps of ``model`` (its attention: ``backend``).

    The CUDA plan's ``DecodeFastPath`` (``worker/platform/cuda.py``).

    num_pool_blocks: pages in the KV pool.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        num_pool_blocks: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.num_pool_blocks = num_pool_blocks
        self.buckets = decode_buckets(max_num_seqs)
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.memory_pool = torch.cuda.graph_pool_handle()

    def applies(self, layouts: Sequence[AttentionLayout]) -> bool:
        """A decode-only step that fits the largest bucket (every group lists the same rows)."""
        layout = layouts[0]
        return not layout.prefills and layout.num_decode_tokens <= self.buckets[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: Sequence[AttentionLayout]
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` of a decode-only step, by graph replay."""
        num_tokens = int(input_ids.shape[0])
        bucket = next(size for size in self.buckets if size >= num_tokens)
        self._fill(input_ids, positions, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            captured = self.graphs[bucket] = self._capture(bucket, layouts)
        else:
            self.backend.copy_for_replay(captured.metadata, layouts)
        self._replay(captured)
        return captured.hidden[:num_tokens]

    def _replay(self, captured: _Graph) -> None:
        """Run a captured bucket over what its buffers hold now."""
        captured.graph.replay()

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, bucket: int) -> None:
        """Copy the step's token ids and positions into the fixed buffers; padding rows get
        token 0 at position 0."""
        num_tokens = int(input_ids.shape[0])
        for static, new in ((self.input_ids, input_ids), (self.positions, positions)):
            static[:num_tokens].copy_(new)
            static[num_tokens:bucket].zero_()

    def _capture(self, bucket: int, layouts: Sequence[AttentionLayout]) -> _Graph:
        """Warm up (compiling attention for these shapes), then record the forward pass."""
        metadata = self.backend.capture_metadata(layouts, bucket, self.num_pool_blocks)
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(ids, positions, metadata)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            hidden = self.model(ids, positions, metadata)
        return _Graph(graph, metadata, hidden)

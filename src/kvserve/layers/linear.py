"""Linear layers whose weights arrive from a checkpoint, possibly in pieces.

Parameters are allocated uninitialised (a random init of weights that the
loader overwrites a moment later would only cost time). A fused layer such as
``qkv_proj`` names its pieces; the loader copies each checkpoint tensor
straight into its rows, so no fused copy is ever assembled on the side.

How the weight is stored and multiplied is the layer's :attr:`Linear.format`
(``layers/weight_format.py``): PyTorch's product on a float weight at first;
GGUF's quantized blocks when the checkpoint hands over
:class:`~kvserve.kernels.quant_weight.QuantizedTensor` pieces; the C kernels'
or a oneDNN-packed layout once the device plan has prepared the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.file_pages import drop_file_pages
from kvserve.kernels.quant_weight import MAX_SEGMENTS, QuantizedTensor, QuantSegment, QuantWeight
from kvserve.layers.weight_copy import copy_weight
from kvserve.layers.weight_format import (
    NATIVE_MAX_ROWS,
    QuantizedWeights,
    TorchWeights,
    WeightFormat,
)

__all__ = ["NATIVE_MAX_ROWS", "Linear"]


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with optional named row ranges for fused checkpoints.

    shards: ordered ``{name: num_rows}``; e.g. ``{"q": 576, "k": 192, "v": 192}``
        makes a fused QKV projection whose rows are q, then k, then v.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        *,
        shards: dict[str, int] | None = None,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if shards is not None:
            out_features = sum(shards.values())
        if out_features is None:
            raise ValueError("Linear needs out_features or shards")
        self.in_features = in_features
        self.out_features = out_features
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for name, num_rows in (shards or {}).items():
            self.shard_rows[name] = (start, start + num_rows)
            start += num_rows
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.format: WeightFormat = TorchWeights()
        # Weight pieces loaded so far (None: the whole weight of an unfused layer), and
        # those that arrived quantized, held until the layer's last piece arrives.
        self._loaded_pieces: set[str | None] = set()
        self._quantized_pieces: dict[str | None, QuantizedTensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.format.apply(self, x)

    def load(
        self, param_name: str, tensor: torch.Tensor | QuantizedTensor, shard: str | None = None
    ) -> None:
        """Copy a checkpoint tensor into ``weight`` or ``bias``, or into one shard of it.

        A :class:`QuantizedTensor` weight is kept in its blocks: once every shard
        has arrived quantized the layer takes :class:`QuantizedWeights` and its
        float ``weight`` shrinks to an empty placeholder (the memory is the point).
        Where quantized and float shards mix, the quantized ones are dequantized
        into the float weight instead.
        """
        if not self.format.loadable:
            raise RuntimeError(
                f"weights cannot be loaded into a layer stored as {type(self.format).__name__}"
            )
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"this layer has no {param_name}")
        target = param.data
        if shard is not None:
            if shard not in self.shard_rows:
                raise ValueError(f"this layer has no shard {shard!r}")
            start, end = self.shard_rows[shard]
            target = target[start:end]
        what = f"checkpoint {param_name}" + ("" if shard is None else f" shard {shard!r}")
        if isinstance(tensor, QuantizedTensor):
            if param_name != "weight":
                tensor = tensor.dequantize()
            else:
                if tensor.shape != tuple(target.shape):
                    raise ValueError(
                        f"{what} has shape {tensor.shape}, expected {tuple(target.shape)}"
                    )
                self._quantized_pieces[shard] = tensor
        if not isinstance(tensor, QuantizedTensor):
            copy_weight(target, tensor, what)
        if param_name == "weight":
            self._loaded_pieces.add(shard)
            # A fused layer may also be loaded whole (shard None).
            if shard is None or self._loaded_pieces >= set(self.shard_rows):
                self._finish_weight()

    def _finish_weight(self) -> None:
        """Every piece of the weight has arrived: keep it quantized if all of it came so."""
        pieces = self._quantized_pieces
        self._quantized_pieces = {}
        if not pieces:
            return
        order: list[str | None] = [None] if None in pieces else list(self.shard_rows)
        segments = _merge_segments([pieces[name] for name in order if name in pieces])
        if len(pieces) == len(order) and len(segments) <= MAX_SEGMENTS:
            self.format = QuantizedWeights(QuantWeight(self.in_features, segments))
            # The float weight was never written: an empty placeholder keeps the
            # parameter's name (and dtype) for the loader's checks.
            empty = torch.empty(0, self.in_features, dtype=self.weight.dtype)
            self.weight = nn.Parameter(empty, requires_grad=False)
            return
        for name, piece in pieces.items():
            rows = self.weight.data
            if name is not None:
                rows = rows[slice(*self.shard_rows[name])]
            copy_weight(rows, piece.dequantize(), "a quantized shard")


def _merge_segments(pieces: list[QuantizedTensor]) -> list[QuantSegment]:
    """One segment per run of adjacent pieces of one type (fewer, longer passes for the kernel)."""
    runs: list[list[QuantizedTensor]] = []
    for piece in pieces:
        if runs and runs[-1][0].qtype == piece.qtype:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    segments = []
    for run in runs:
        if len(run) == 1:
            segments.append(run[0].segment())
        else:
            data = torch.cat([piece.data for piece in run])
            # The joined copy is what the layer keeps: the file's pages read to make it
            # would otherwise stay resident beside it.
            for piece in run:
                drop_file_pages(piece.data)
            segments.append(QuantSegment(run[0].qtype, int(data.shape[0]), data))
    return segments

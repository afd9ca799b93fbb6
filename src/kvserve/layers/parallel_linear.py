"""Linear layers split across tensor-parallel ranks (Megatron-style column and row splits).

A transformer block needs one pair of them per sub-layer:

- :class:`ColumnParallelLinear` keeps a contiguous slice of the output rows
  (``W`` is ``[out, in]``): for the fused q/k/v projection, each of q, k and v
  is split evenly, so a rank holds whole heads (and GQA groups, when the KV
  heads split evenly too); for the fused gate/up projection, each half is
  split. Its output is the rank's columns of the activation; no communication.
- :class:`RowParallelLinear` keeps the matching slice of the input columns
  (``o_proj``, ``down_proj``): each rank's product is a partial sum of the
  full output, and one all-reduce adds them up. A bias is added once, by
  rank 0 (the other ranks hold zeros), so the sum carries it exactly once.

With one rank both are plain :class:`Linear` layers. Checkpoint tensors come
in whole; ``load`` checks the whole shape and keeps the rank's slice, so a
rank never holds more than its share of a weight (past the one tensor being
loaded).
"""

from __future__ import annotations

import torch

from kvserve.distributed.group import TensorParallelGroup
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.layers.linear import Linear


def _split(total: int, tp: TensorParallelGroup, what: str) -> int:
    """The rank's share of ``total`` rows or columns (they must split evenly)."""
    if total % tp.size:
        raise ValueError(f"{what} ({total}) does not split evenly over {tp.size} ranks")
    return total // tp.size


def _check_whole(tensor: torch.Tensor | QuantizedTensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {shape}")


class ColumnParallelLinear(Linear):
    """``Linear`` holding this rank's output rows: ``1/size`` of each named shard.

    in_features, out_features, shards: the whole layer's, as for :class:`Linear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | None = None,
        *,
        tp: TensorParallelGroup,
        shards: dict[str, int] | None = None,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        local_shards = (
            None
            if shards is None
            else {name: _split(rows, tp, f"shard {name!r}") for name, rows in shards.items()}
        )
        local_out = None if out_features is None else _split(out_features, tp, "out_features")
        super().__init__(in_features, local_out, shards=local_shards, bias=bias, dtype=dtype)
        self.tp = tp

    def load(
        self, param_name: str, tensor: torch.Tensor | QuantizedTensor, shard: str | None = None
    ) -> None:
        """Keep this rank's rows of a whole checkpoint tensor (or of one shard of it).

        A quantized weight splits by whole rows too, block layout untouched.
        """
        if shard is not None:
            if shard not in self.shard_rows:
                raise ValueError(f"this layer has no shard {shard!r}")
            start, end = self.shard_rows[shard]
            rows = end - start
        else:
            rows = self.out_features
        whole = (rows * self.tp.size, *((self.in_features,) if param_name == "weight" else ()))
        what = f"checkpoint {param_name}" + ("" if shard is None else f" shard {shard!r}")
        _check_whole(tensor, whole, what)
        first = self.tp.rank * rows
        if isinstance(tensor, QuantizedTensor):
            super().load(param_name, tensor.take_rows(slice(first, first + rows)), shard)
        else:
            super().load(param_name, tensor[first : first + rows], shard)


class RowParallelLinear(Linear):
    """``Linear`` holding this rank's input columns; ``forward`` all-reduces the output.

    in_features, out_features: the whole layer's. The input is this rank's
    ``in_features / size`` columns of the activation (a column-parallel
    layer's output); the output is the whole ``[T, out_features]`` on every rank.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: TensorParallelGroup,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(
            _split(in_features, tp, "in_features"), out_features, bias=bias, dtype=dtype
        )
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def load(
        self, param_name: str, tensor: torch.Tensor | QuantizedTensor, shard: str | None = None
    ) -> None:
        """Keep this rank's columns of a whole weight; rank 0 alone keeps the bias.

        A quantized weight is taken whole on one rank only: splitting its columns
        would cut through its blocks (the CPU plan dequantizes GGUF files when
        ``tensor_parallel_size > 1``).
        """
        if isinstance(tensor, QuantizedTensor):
            if self.tp.size > 1:
                raise ValueError(
                    "a quantized weight cannot be split by input columns over ranks; "
                    "load it with quantization='none'"
                )
            super().load(param_name, tensor, shard)
            return
        if param_name == "weight":
            whole = (self.out_features, self.in_features * self.tp.size)
            _check_whole(tensor, whole, "checkpoint weight")
            first = self.tp.rank * self.in_features
            tensor = tensor[:, first : first + self.in_features]
        elif self.tp.rank != 0:
            _check_whole(tensor, (self.out_features,), f"checkpoint {param_name}")
            tensor = torch.zeros_like(tensor)
        super().load(param_name, tensor, shard)

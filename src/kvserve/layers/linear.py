"""Linear layers whose weights arrive from a checkpoint, possibly in pieces.

Parameters are allocated uninitialised (a random init of weights that the
loader overwrites a moment later would only cost time). A fused layer such as
``qkv_proj`` names its pieces; the loader copies each checkpoint tensor
straight into its rows, so no fused copy is ever assembled on the side.

After loading, the model runner may replace a weight by a copy pre-packed in
the CPU matmul library's blocked layout (``packed``): the same numbers, laid
out so each product no longer re-packs the weight on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NativeOps
from kvserve.layers.weight_copy import copy_weight

# Up to this many rows the C kernel beats BLAS on float32 weights (measured on an
# AVX2 EPYC: 1.7x at one row, 2.9x at 4, 1.3x at 64, 1.2x at 256, even at 1024).
# bfloat16 weights with float32 rows always take the C kernels (see ops.linear).
NATIVE_MAX_ROWS = 512


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
        # True once ``weight`` holds oneDNN's blocked layout (see worker/cpu_weights.py);
        # it is then only meaningful to the packed matmul below.
        self.packed: bool = False
        # Set by the model runner when the C kernels serve this layer's small products.
        self.native: NativeOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Small products go to the kernel; so do all of bf16 weights with float32 inputs.
        if (
            self.native is not None
            and x.dim() == 2
            and (x.shape[0] <= NATIVE_MAX_ROWS or self.weight.dtype != x.dtype)
        ):
            return self.native.linear(x, self.weight, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor into ``weight`` or ``bias``, or into one shard of it."""
        if self.packed:
            raise RuntimeError("weights cannot be loaded into a packed layer")
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"this layer has no {param_name}")
        target = param.data
        if shard is not None:
            start, end = self.shard_rows[shard]
            target = target[start:end]
        what = f"checkpoint {param_name}" + ("" if shard is None else f" shard {shard!r}")
        copy_weight(target, tensor, what)

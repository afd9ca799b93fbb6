"""Token embeddings whose table arrives from a checkpoint, as floats or in quantized blocks.

A float table behaves as ``nn.Embedding``. A table that arrives as a
:class:`QuantizedTensor` (a GGUF file's ``token_embd``, or one quantized at
load by ``--quantization``) stays in its blocks: a lookup dequantizes only
the rows of the tokens asked for, so a large vocabulary (Gemma 3: 262k rows
of 640) costs its quantized bytes, not a float copy. A tied LM head multiplies
by the same blocks through :meth:`VocabEmbedding.logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import NativeOps
from kvserve.kernels.quant_weight import QuantizedTensor, QuantWeight
from kvserve.layers.weight_copy import copy_weight


class VocabEmbedding(nn.Module):
    """``num_embeddings`` rows of ``embedding_dim`` values, looked up by token id.

    weight: the float table ``[num_embeddings, embedding_dim]`` in ``dtype``;
        once a quantized table is loaded it is an empty ``[0, embedding_dim]``
        parameter (it still carries the dtype lookups return) and
        :attr:`qweight` holds the table.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # Uninitialised, as every parameter the loader overwrites.
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.qweight: QuantWeight | None = None
        # float32 copy of a quantized table, made on the first logits without the kernels.
        self._dequantized: torch.Tensor | None = None
        # Set by the model runner when the C kernels serve the quantized lookups and logits.
        self.native: NativeOps | None = None

    @property
    def quantized(self) -> bool:
        """Whether the table is held in quantized blocks (:attr:`qweight`)."""
        return self.qweight is not None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids of any shape → their rows ``[*ids.shape, embedding_dim]`` in ``weight``'s dtype."""
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        flat_ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if flat_ids.numel() and (
            int(flat_ids.min()) < 0 or int(flat_ids.max()) >= self.num_embeddings
        ):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings})")
        if self.native is not None:
            rows = self.native.dequant_rows(self.qweight, flat_ids.contiguous())
        else:
            # Without the kernels: gguf's dequantizer on just these rows.
            table = self.qweight.segments[0]
            blocks = QuantizedTensor(table.qtype, table.rows, self.embedding_dim, table.data)
            rows = blocks.take_rows(flat_ids).dequantize()
        rows = rows.to(device=ids.device, dtype=self.weight.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, embedding_dim]`` times the table: float32 ``[N, num_embeddings]``.

        A tied LM head's product. With a quantized table the C kernels multiply
        its blocks as they are; without them, a float32 copy of the table is
        made once and multiplied.
        """
        if self.qweight is None:
            return F.linear(hidden, self.weight).float()
        if self.native is not None and hidden.dim() == 2:
            return self.native.linear_quant(hidden.float().contiguous(), self.qweight, None)
        if self._dequantized is None:
            self._dequantized = self.qweight.dequantize()
        return F.linear(hidden.float(), self._dequantized)

    def load(
        self, param_name: str, tensor: torch.Tensor | QuantizedTensor, shard: str | None = None
    ) -> None:
        """Take the checkpoint table: copied into ``weight``, or kept in its quantized blocks.

        A quantized table replaces ``weight`` by an empty parameter, so the
        float table is never allocated beside it.
        """
        if param_name != "weight" or shard is not None:
            raise ValueError(f"an embedding has one weight, not {param_name!r} shard {shard!r}")
        if not isinstance(tensor, QuantizedTensor):
            copy_weight(self.weight.data, tensor, "checkpoint weight")
            return
        expected = (self.num_embeddings, self.embedding_dim)
        if tensor.shape != expected or self.weight.shape != expected:
            raise ValueError(
                f"checkpoint weight has shape {tensor.shape}, expected {tuple(self.weight.shape)}"
            )
        self.qweight = QuantWeight(self.embedding_dim, [tensor.segment()])
        self._dequantized = None
        self.weight = nn.Parameter(
            torch.empty(0, self.embedding_dim, dtype=self.weight.dtype), requires_grad=False
        )

    def extra_repr(self) -> str:
        kind = self.qweight.segments[0].qtype.name if self.qweight is not None else "float"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"

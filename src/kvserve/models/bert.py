"""BERT: a bidirectional encoder, for sentence embeddings (all-MiniLM-L6-v2 and its kin).

What sets it apart from the decoders: every token attends to every token of
its own sequence (no causal mask, no KV cache: a sequence is encoded whole,
in one step, and nothing of it is kept); positions are a learned table and
each token also adds a token-type (segment) row, type 0 for the single
sentences embeddings take; LayerNorms come after each sublayer (post-norm,
``norm(x + attn(x))``) and once over the embeddings; the MLP is up, GELU,
down. There is no LM head: the model's output is the final hidden states,
which the runner pools into one vector per request (``layers/pooler.py``).

Modules carry the names of Hugging Face's ``BertModel``
(``encoder.layer.0.attention.output.dense``) so checkpoint names map onto
parameters one to one, except q, k and v, which load into one fused
projection (one matmul instead of three). The projections are the shared
:class:`Linear` and the norms the shared :class:`LayerNorm`, so the device
plan hands them the C kernels as it does for the decoders.

The flat batch holds whole sequences one after another; attention runs on
each sequence's rows where they lie (no padding, no mask): on CPU with the C
kernels one call a layer for the whole step (``NativeOps.encoder_attention``),
elsewhere one PyTorch call per sequence and layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionLayout, AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.kernels import NativeOps
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.layers.activation import GELU
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm
from kvserve.models.arch_config import ArchConfig
from kvserve.models.weight_loader import WeightTarget, load_checkpoint

# Checkpoint tensors an encoder does not use: the position ids buffer, the pretraining
# heads (``cls.``) and BertModel's pooler (a dense + tanh over [CLS] that sentence
# embeddings do not go through).
_UNUSED_PREFIXES = ("embeddings.position_ids", "pooler.", "cls.")
_QKV = {"query": "q", "key": "k", "value": "v"}


@dataclass(frozen=True)
class EncoderBatch:
    """The sequences of a step's flat batch (built once a step, read by every layer).

    num_single: the first ``num_single`` rows are sequences of one token each.
    spans: ``(start row, length)`` of each longer sequence, in flat order after them.
    """

    num_single: int
    spans: tuple[tuple[int, int], ...]
    # Every sequence's first row and length, single-token ones included (int64 [2, S]):
    # what the C kernel reads.
    span_rows: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts = list(range(self.num_single)) + [start for start, _ in self.spans]
        lens = [1] * self.num_single + [length for _, length in self.spans]
        rows = torch.tensor([starts, lens], dtype=torch.int64).reshape(2, len(starts))
        object.__setattr__(self, "span_rows", rows)

    @classmethod
    def from_layout(cls, layout: AttentionLayout) -> EncoderBatch:
        """The sequences of a step's layout: single-token rows first, then the prefill chunks.

        Every chunk must be a whole sequence (``context_len`` 0): an encoder
        attends over all of a sequence at once, so it cannot continue one.
        """
        spans = []
        for chunk in layout.prefills:
            if chunk.context_len != 0:
                raise ValueError("an encoder runs each sequence whole, in one step")
            spans.append((chunk.query_start, chunk.query_len))
        return cls(layout.num_decode_tokens, tuple(spans))


class BertSelfAttention(nn.Module):
    """Multi-head attention over each whole sequence (the output projection is the layer's)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        size = self.num_heads * self.head_dim
        self.qkv = Linear(hidden, shards={"q": size, "k": size, "v": size}, bias=True, dtype=dtype)
        # Set by the worker when the C kernel can do it (float32 on CPU; head_dim a
        # multiple of 8 up to 256, as every BERT-family encoder's is).
        self.native: NativeOps | None = None

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads = self.num_heads
        qkv = self.qkv(hidden)
        if self.native is not None and qkv.dtype == torch.float32 and self.head_dim % 8 == 0:
            return self.native.encoder_attention(
                qkv, batch.span_rows, heads, self.head_dim, self.head_dim**-0.5
            )
        qkv = qkv.view(num_tokens, 3 * heads, self.head_dim)  # [T, 3H, D]
        # A one-token sequence attends to itself alone: its output is its v.
        outs = [qkv[: batch.num_single, 2 * heads :]]
        for start, length in batch.spans:
            # One call per sequence, unpadded and unmasked: on CPU this beats one padded,
            # masked call (measured: 2.5 ms against 4.8 for 15 sentences of 15-80 tokens).
            q, k, v = qkv[start : start + length].transpose(0, 1).split(heads)  # [H, n, D] each
            outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1))
        return torch.cat(outs).reshape(num_tokens, heads * self.head_dim)


class _DenseNorm(nn.Module):
    """A projection and the LayerNorm after it (Hugging Face's ``*.output`` modules)."""

    def __init__(self, in_features: int, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(in_features, arch.hidden_size, bias=True, dtype=dtype)
        self.LayerNorm = LayerNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``norm(residual + dense(x))``; may add into ``residual`` in place."""
        return self.LayerNorm.add_and_norm(self.dense(x), residual)[0]


class BertAttention(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = BertSelfAttention(arch, dtype)
        self.output = _DenseNorm(arch.num_attention_heads * arch.head_dim, arch, dtype)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self_attn(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(arch.hidden_size, arch.intermediate_size, bias=True, dtype=dtype)
        self.act = GELU.named(arch.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    """Post-norm: ``x = norm1(x + attn(x))``, then ``x = norm2(x + down(gelu(up(x))))``."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(arch, dtype)
        self.intermediate = BertIntermediate(arch, dtype)
        self.output = _DenseNorm(arch.intermediate_size, arch, dtype)

    def forward(self, hidden: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        # Each norm may add into its residual in place: neither is read again.
        hidden = self.attention(hidden, batch)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch, dtype) for _ in range(arch.num_hidden_layers))


class BertEmbeddings(nn.Module):
    """Token row + position row + token-type row 0, then a LayerNorm."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.word_embeddings = VocabEmbedding(arch.vocab_size, hidden, dtype)
        self.position_embeddings = nn.Embedding.from_pretrained(
            torch.empty(arch.max_position_embeddings, hidden, dtype=dtype), freeze=True
        )
        self.token_type_embeddings = nn.Embedding.from_pretrained(
            torch.empty(arch.type_vocab_size or 1, hidden, dtype=dtype), freeze=True
        )
        self.LayerNorm = LayerNorm(hidden, arch.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Single sentences are segment A (type 0), as sentence-transformers encodes them.
        summed = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(summed)


class BertModel(nn.Module):
    """The encoder on one flat stream of whole sequences; built as the registry builds
    every model (``cls(arch, max_position, dtype, backend, tp)``), on one rank.

    ``forward`` returns the final hidden states ``[T, hidden_size]``; there is no
    ``compute_logits``: the model embeds and never generates.
    """

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        if max_position > arch.max_position_embeddings:
            raise ValueError(
                f"max_position {max_position} is past BERT's {arch.max_position_embeddings} "
                "learned positions"
            )
        if tp.size != 1:
            raise ValueError("BERT runs on one rank")
        self.arch = arch
        self.embeddings = BertEmbeddings(arch, dtype)
        self.encoder = BertEncoder(arch, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` of whole sequences → hidden states ``[T, hidden_size]``.

        Only the layout of the metadata is read (where each sequence starts and
        how long it is): the encoder keeps no KV cache.
        """
        batch = EncoderBatch.from_layout(attn_metadata.groups[0].layout)
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy a ``BertModel`` checkpoint (names with or without ``bert.``) into the parameters;
        ModelLoadError as ``weight_loader.load_checkpoint`` raises it."""
        load_checkpoint(self, weights, _weight_target)


def _weight_target(name: str) -> WeightTarget | None:
    name = name.removeprefix("bert.")
    if name.startswith(_UNUSED_PREFIXES):
        return None
    parts = name.split(".")
    # encoder.layer.N.attention.self.{query,key,value}.{weight,bias} → the fused projection.
    if len(parts) == 7 and parts[4] == "self" and parts[5] in _QKV:
        fused = ".".join([*parts[:4], "self_attn", "qkv", parts[6]])
        return WeightTarget(fused, shard=_QKV[parts[5]])
    return WeightTarget(name)

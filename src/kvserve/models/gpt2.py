"""GPT-2: learned position embeddings, LayerNorm, a GELU MLP, biases everywhere, tied LM head.

Modules carry the names of Hugging Face's ``GPT2LMHeadModel`` (``transformer.h.0.attn.c_attn``),
so checkpoint names map onto parameters one to one. Hugging Face stores GPT-2's
projections as Conv1D weights, ``[in, out]``; they are transposed into the
shared :class:`Linear` (``[out, in]``) as they load, so the same matmul paths
(and the C kernels, where the runner enables them) serve GPT-2 and Llama alike.
Attention runs through the shared :class:`Attention` layer on the paged KV cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.layers.activation import GELU
from kvserve.layers.attention import Attention
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.decoder_model import DecoderLayerLayout
from kvserve.models.weight_loader import WeightTarget

# Conv1D weights stored ``[in, out]`` in Hugging Face checkpoints.
_CONV1D_WEIGHT = re.compile(
    r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"
)
# Buffers some checkpoints store next to the weights: the causal mask (``attn.bias``,
# a [1, 1, n_positions, n_positions] bool or float tensor) and the masked value. The
# attention backend masks by position, so they are not needed.
_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)$")


class GPT2Attention(nn.Module):
    """Multi-head attention with one fused ``c_attn`` projection for q, k and v."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        # Rows: q, then k, then v, each [hidden]; the checkpoint stores them fused the same way.
        self.c_attn = Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.c_proj = Linear(hidden, hidden, bias=True, dtype=dtype)
        self.attn = Attention(
            self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, backend
        )

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # [T, 3 H, D] → q, k, v each [T, H, D].
        qkv = self.c_attn(hidden).view(num_tokens, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.split(self.num_heads, dim=1)
        out = self.attn(q, k, v, attn_metadata)  # [T, H, D]
        return self.c_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.c_fc = Linear(arch.hidden_size, arch.intermediate_size, bias=True, dtype=dtype)
        self.c_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=True, dtype=dtype)
        self.act = GELU.named(arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.attn = GPT2Attention(arch, dtype, backend)
        self.ln_2 = LayerNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = GPT2MLP(arch, dtype)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, attn_metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on the residual stream, as Llama's decoder layer runs it.

        The previous block's output is added to the stream together with
        ``ln_1`` (one pass); ``residual`` is None for the first block, whose
        input is the stream itself. Returns the block's MLP output and the
        stream, which the next block (or ``ln_f``) adds together.
        """
        if residual is None:
            residual = hidden
            normed = self.ln_1(hidden)
        else:
            normed, residual = self.ln_1.add_and_norm(hidden, residual)
        attn_out = self.attn(normed, attn_metadata)
        normed, residual = self.ln_2.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual

    def decode_layout(self) -> DecoderLayerLayout:
        """This block's parts for the native decode stack: LayerNorms, biases, no RoPE."""
        return DecoderLayerLayout(
            input_norm=self.ln_1,
            qkv=self.attn.c_attn,
            attention=self.attn.attn,
            o_proj=self.attn.c_proj,
            mlp_norm=self.ln_2,
            up=self.mlp.c_fc,
            act=self.mlp.act,
            down=self.mlp.c_proj,
            rope_table=None,
        )


class GPT2Model(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype)
        # One learned row per position the checkpoint was trained for.
        self.wpe = nn.Embedding.from_pretrained(
            torch.empty(arch.max_position_embeddings, arch.hidden_size, dtype=dtype), freeze=True
        )
        self.h = nn.ModuleList(
            GPT2Block(arch, dtype, backend) for _ in range(arch.num_hidden_layers)
        )
        self.ln_f = LayerNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token's embedding plus its position's: ``[T]`` ids and positions → ``[T, hidden]``."""
        return self.wte(input_ids) + self.wpe(positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        residual: torch.Tensor | None = None
        for block in self.h:
            hidden, residual = block(hidden, residual, attn_metadata)
        if residual is None:  # a model without blocks
            return self.ln_f(hidden)
        return self.ln_f.add_and_norm(hidden, residual)[0]

    # With embed above, the DecoderModel interface (models/decoder_model.py).
    def rope_tables(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """None: positions are learned embeddings, added by :meth:`embed`."""
        return []

    def decoder_layers(self) -> Sequence[nn.Module]:
        return list(self.h)

    def final_norm(self) -> LayerNorm:
        return self.ln_f


class GPT2LMHeadModel(CausalLM):
    """The GPT-2 decoder under ``transformer.`` plus the LM head (see :class:`CausalLM`).

    ``max_position`` must not exceed ``arch.max_position_embeddings``: positions
    past the learned table have no embedding (the engine caps its context there).
    Loads a ``GPT2LMHeadModel`` checkpoint (``transformer.``-prefixed names) or a
    bare ``GPT2Model`` one (``h.0.attn.c_attn.weight``, as the original ``gpt2``
    repo stores it).
    """

    transformer: GPT2Model

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        if max_position > arch.max_position_embeddings:
            raise ValueError(
                f"max_position {max_position} is past GPT-2's {arch.max_position_embeddings} "
                "learned positions"
            )
        decoder = GPT2Model(arch, dtype, backend)
        super().__init__(arch, "transformer", decoder, decoder.wte, dtype, tp)

    def weight_target(self, name: str) -> WeightTarget | None:
        if not name.startswith("transformer."):
            name = "transformer." + name
        if _MASK_BUFFER.match(name):
            return None
        return WeightTarget(name, transpose=_CONV1D_WEIGHT.match(name) is not None)

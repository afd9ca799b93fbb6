"""The Llama family: Llama, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Differences between them are flags on :class:`ArchConfig`. The model runs on
one flat stream of tokens with explicit positions and attention metadata;
q/k/v and gate/up projections are fused into single matrix products.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.attention.native_paged import NativePagedAttention
from kvserve.errors import ModelLoadError
from kvserve.kernels import DecodeLayerWeights, DecodeStack, NativeOps
from kvserve.layers.attention import Attention
from kvserve.layers.linear import Linear
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, apply_rotary
from kvserve.models.arch_config import ArchConfig


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            arch.hidden_size,
            shards={"q": q_size, "k": kv_size, "v": kv_size},
            bias=arch.attention_bias,
            dtype=dtype,
        )
        self.o_proj = Linear(q_size, arch.hidden_size, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend
        )
        # Set by the model runner when a C kernel rotates q and k in place (float32 on CPU).
        self.native: NativeOps | None = None

    def forward(
        self, rope: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """rope: ``[T, 2, D]`` cosines and sines of the tokens' positions."""
        num_tokens = hidden.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv_flat = self.qkv_proj(hidden)
        # [T, Hq + 2 Hkv, D]: the heads of q, then k, then v.
        qkv = qkv_flat.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, num_qk_heads:]
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, : self.num_heads]), rope)
            k = apply_rotary(self.k_norm(qkv[:, self.num_heads : num_qk_heads]), rope)
        elif self.native is not None:
            self.native.rotary_(qkv_flat, rope, num_qk_heads, self.head_dim)
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : num_qk_heads]
        else:
            # One rotation for the q and k heads together: half the elementwise ops.
            qk = apply_rotary(qkv[:, :num_qk_heads], rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, attn_metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, shards={"gate": size, "up": size}, dtype=dtype)
        self.down_proj = Linear(size, arch.hidden_size, dtype=dtype)
        # Set by the model runner when a C kernel does silu(gate) * up (float32 on CPU).
        self.native: NativeOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None:
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(arch, dtype, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(arch, dtype)
        self._decode_weights: DecodeLayerWeights | None = None
        self._decode_weights_read = False

    def forward(
        self,
        rope: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm block on the residual stream.

        The previous block's output is added to the stream here, together with
        the norm that follows (one pass); ``residual`` is None for the first
        block, whose input is the stream itself. Returns the block's output and
        the stream, which the next block (or the final norm) adds together.
        """
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(rope, normed, attn_metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual

    def decode_weights(self) -> DecodeLayerWeights | None:
        """What the one-call decode kernel needs of this layer, or None where it does not apply.

        It applies to float32 (or bf16-weight) layers on the native attention
        backend without q/k norms; read once, on first use.
        """
        if not self._decode_weights_read:
            self._decode_weights = self._read_decode_weights()
            self._decode_weights_read = True
        return self._decode_weights

    def _read_decode_weights(self) -> DecodeLayerWeights | None:
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weight_dtypes = {linear.weight.dtype for linear in linears}
        if (
            attn.q_norm is not None
            or not isinstance(attn.attn.backend, NativePagedAttention)
            or any(linear.packed for linear in linears)
            or any(linear.bias is not None for linear in linears[1:])
            or len(weight_dtypes) != 1
            or weight_dtypes & {torch.float32, torch.bfloat16} != weight_dtypes
            or self.input_layernorm.weight.dtype != torch.float32
        ):
            return None
        qkv_bias = attn.qkv_proj.bias
        return DecodeLayerWeights(
            norms=(
                self.input_layernorm.weight.data_ptr(),
                self.post_attention_layernorm.weight.data_ptr(),
            ),
            linears=(
                attn.qkv_proj.weight.data_ptr(),
                None if qkv_bias is None else qkv_bias.data_ptr(),
                attn.o_proj.weight.data_ptr(),
                mlp.gate_up_proj.weight.data_ptr(),
                mlp.down_proj.weight.data_ptr(),
            ),
            bf16=weight_dtypes == {torch.bfloat16},
            eps=self.input_layernorm.eps,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate_size=mlp.down_proj.in_features,
            scale=attn.attn.scale,
        )


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ArchConfig, max_position: int, dtype: torch.dtype, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype), freeze=True
        )
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, backend) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        # Set by the model runner when the C kernels serve this model (float32 on CPU);
        # decode-only steps then run every layer in one call.
        self.native: NativeOps | None = None
        self._decode_stack: DecodeStack | None = None
        self._decode_stack_pool: int | None = None  # the KV pool's address it was read for

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)  # looked up once, shared by every layer
        if self.native is not None and not attn_metadata.prefills:
            stack = self.decode_stack()
            if stack is not None:
                # hidden becomes the residual stream, updated in place.
                out = self.native.llama_decode_layers(
                    stack,
                    hidden,
                    rope,
                    attn_metadata.slot_mapping,
                    attn_metadata.decode_block_tables,
                    attn_metadata.decode_seq_lens,
                )
                return self.norm.add_and_norm(out, hidden)[0]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, attn_metadata)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    def decode_stack(self) -> DecodeStack | None:
        """Every layer as the one-call decode kernel reads them, or None where it does not apply.

        Read on first use, once the runner has bound the KV pool, and again if
        the pool is rebound.
        """
        if len(self.layers) == 0:
            return None
        # Once per step: only the first layer's pool is looked at unless it moved.
        pool = cast(LlamaDecoderLayer, self.layers[0]).self_attn.attn.kv_cache
        if pool.numel() == 0:
            return None
        if self._decode_stack_pool != pool.data_ptr():
            self._decode_stack_pool = pool.data_ptr()
            layers = [cast(LlamaDecoderLayer, layer) for layer in self.layers]
            caches = [layer.self_attn.attn.kv_cache for layer in layers]
            weights = [layer.decode_weights() for layer in layers]
            applies = all(w is not None for w in weights)
            self._decode_stack = (
                DecodeStack([w for w in weights if w is not None], caches) if applies else None
            )
        return self._decode_stack


# Checkpoint name → (our parameter name, shard of a fused layer).
_FUSED_SHARDS = [
    (re.compile(r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\3", 2),
    (re.compile(r"(.*)\.mlp\.(gate|up)_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 2),
]


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` the logits."""

    def __init__(
        self, arch: ArchConfig, max_position: int, dtype: torch.dtype, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, max_position, dtype, backend)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, dtype=dtype)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` → hidden states ``[T, hidden_size]``."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` of the sampling positions → float32 logits ``[N, V]``."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, one at a time.

        Raises ModelLoadError when a tensor is unknown, mis-shaped, or when a
        parameter was never loaded.
        """
        modules = dict(self.named_modules())
        expected = self._expected_tensors()
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # some tied checkpoints still store the head
            target_name, shard = name, None
            for pattern, replacement, shard_group in _FUSED_SHARDS:
                match = pattern.match(name)
                if match:
                    target_name, shard = pattern.sub(replacement, name), match.group(shard_group)
                    break
            module_name, _, param_name = target_name.rpartition(".")
            module = modules.get(module_name)
            if module is None or (target_name, shard) not in expected:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            try:
                if isinstance(module, Linear):
                    module.load(param_name, tensor, shard)
                else:
                    getattr(module, param_name).data.copy_(tensor)
            except (RuntimeError, ValueError) as exc:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {exc}") from exc
            loaded.add((target_name, shard))
        unloaded = expected - loaded
        if unloaded:
            missing = ", ".join(sorted(f"{n}[{s}]" if s else n for n, s in unloaded)[:5])
            raise ModelLoadError(f"checkpoint lacks {len(unloaded)} tensors, e.g. {missing}")

    def _expected_tensors(self) -> set[tuple[str, str | None]]:
        """Every (parameter, shard) a complete checkpoint fills; shard None for unfused ones."""
        expected: set[tuple[str, str | None]] = set()
        for module_name, module in self.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                full_name = f"{module_name}.{param_name}"
                if full_name == "lm_head.weight" and self.arch.tie_word_embeddings:
                    continue  # the embedding's weight, loaded under its own name
                shards = module.shard_rows if isinstance(module, Linear) else {}
                expected.update((full_name, shard) for shard in shards or [None])
        return expected

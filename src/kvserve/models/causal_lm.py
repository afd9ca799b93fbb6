"""The model base every family's class is: a decoder and an LM head, and what they share.

A family's class builds its decoder and hands it here; the base registers
it under the checkpoint's prefix, adds the LM head (tied to the token
embeddings when the config says so), and runs ``forward``,
``compute_logits`` and ``load_weights`` the same way for every family. The
family supplies only what differs, as two small hooks on checkpoint names:
:meth:`CausalLM.checkpoint_tensors` (rename or adjust tensors as they arrive)
and :meth:`CausalLM.weight_target` (where each one goes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.kernels.quant_weight import QuantizedTensor
from kvserve.layers.linear import Linear
from kvserve.models.arch_config import ArchConfig
from kvserve.models.decoder_model import DecoderModel
from kvserve.models.weight_loader import WeightTarget, load_checkpoint

# One checkpoint tensor: its name in the checkpoint and its values (a GGUF matrix
# may stay in its quantized blocks: see weight_loader.TakesQuantized).
CheckpointTensor = tuple[str, torch.Tensor | QuantizedTensor]


class CausalLM(nn.Module):
    """A decoder-only language model on one flat stream of tokens.

    Each family's class is built as ``cls(arch, max_position, dtype, backend, tp)``
    with uninitialised parameters, filled by :meth:`load_weights`;
    ``max_position`` is the longest sequence the engine will run (at most
    ``arch.max_position_embeddings``); ``tp``: the tensor-parallel ranks this
    model's layers are split over (families that cannot be split are only
    built with one rank, see ``families.Family.tensor_parallel``). It builds
    its decoder and calls this ``__init__`` with it.

    decoder_prefix: the decoder's name, the prefix of its checkpoint names
        (``model``, ``transformer``); the decoder is that attribute (and :meth:`decoder`).
    decoder: maps ``input_ids``, ``positions`` ``[T]`` and the attention
        metadata to the final hidden states ``[T, hidden_size]``, norm applied.
    embed_tokens: the decoder's token embeddings, which a tied LM head shares.
    """

    arch: ArchConfig
    lm_head: Linear

    def __init__(
        self,
        arch: ArchConfig,
        decoder_prefix: str,
        decoder: nn.Module,
        embed_tokens: nn.Embedding,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.decoder_prefix = decoder_prefix
        # Registered before the head: a tied weight is then known by the embedding's
        # name, the one checkpoints store it under (see weight_loader.expected_tensors).
        self.add_module(decoder_prefix, decoder)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, dtype=dtype)
        if arch.tie_word_embeddings:
            # A Parameter, though nn.Embedding types its weight as a Tensor.
            self.lm_head.weight = cast(nn.Parameter, embed_tokens.weight)

    def decoder(self) -> DecoderModel:
        """The decoder inside the model (the module under :attr:`decoder_prefix`), for the
        worker's fast paths (``models/decoder_model.py``); the LM head stays with
        :meth:`compute_logits`."""
        return cast(DecoderModel, self.get_submodule(self.decoder_prefix))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` → hidden states ``[T, hidden_size]``."""
        hidden: torch.Tensor = self.decoder()(input_ids, positions, attn_metadata)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` of the sampling positions → float32 logits ``[N, V]``.

        Soft-capped to ``cap * tanh(logits / cap)`` where the config sets
        ``final_logit_softcapping`` (Gemma 2).
        """
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[CheckpointTensor]) -> None:
        """Copy checkpoint tensors (Hugging Face names and layout) into the parameters, one at a time.

        Raises ModelLoadError when a tensor is unknown, given twice, mis-shaped,
        or when a parameter was never loaded (see ``weight_loader.load_checkpoint``).
        """
        load_checkpoint(self, self.checkpoint_tensors(weights), self._target_of)

    def checkpoint_tensors(self, weights: Iterable[CheckpointTensor]) -> Iterable[CheckpointTensor]:
        """Hook: the checkpoint's tensors as :meth:`weight_target` expects them; as stored here."""
        return weights

    def weight_target(self, name: str) -> WeightTarget | None:
        """Hook: the parameter checkpoint tensor ``name`` fills (never the LM head's),
        or None for a tensor the model does not need; here, the parameter of that name."""
        return WeightTarget(name)

    def _target_of(self, name: str) -> WeightTarget | None:
        if name == "lm_head.weight":
            # Some tied checkpoints still store the head: the embedding is loaded instead.
            return None if self.arch.tie_word_embeddings else WeightTarget(name)
        return self.weight_target(name)

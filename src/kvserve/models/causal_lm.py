"""The interface every model class offers the model runner."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention import AttentionBackend, AttentionMetadata
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.models.arch_config import ArchConfig


class CausalLM(nn.Module):
    """A decoder-only language model on one flat stream of tokens.

    Subclasses are built as ``cls(arch, max_position, dtype, backend, tp)``
    with uninitialised parameters, filled by :meth:`load_weights`;
    ``max_position`` is the longest sequence the engine will run (at most
    ``arch.max_position_embeddings``); ``tp``: the tensor-parallel ranks this
    model's layers are split over (families that cannot be split are only
    built with one rank, see ``registry.ModelFamily``).
    """

    arch: ArchConfig

    def __init__(
        self,
        arch: ArchConfig,
        max_position: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` → hidden states ``[T, hidden_size]``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` of the sampling positions → float32 logits ``[N, V]``."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names and layout) into the parameters.

        Raises ModelLoadError when a tensor is unknown, given twice, mis-shaped,
        or when a parameter was never loaded (see ``weight_loader.load_checkpoint``).
        """
        raise NotImplementedError

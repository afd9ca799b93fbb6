"""Pooling: one vector per sequence from a model's last hidden states.

How a model's vectors are pooled is part of the model, fixed when it was
trained: sentence-transformers folders say it in ``modules.json`` and
``1_Pooling/config.json`` (``loader/pooling_config.py`` reads them), and a
decoder used as an embedder takes the last token or the mean (``--task embed
--pooling-type``). A pooler computed differently from training gives vectors
that look fine and retrieve badly, so kvserve follows the folder exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

PoolingType = Literal["mean", "cls", "last"]
POOLING_TYPES: tuple[PoolingType, ...] = get_args(PoolingType)


@dataclass(frozen=True)
class PoolingConfig:
    """pooling_type: ``mean`` (over every token), ``cls`` (the first token, BERT's
        [CLS]) or ``last`` (the last token: a causal model's only one that saw all).
    normalize: vectors are scaled to unit length (cosine similarity is then a dot product).
    dimensions: the vector's full size (the hidden size).
    matryoshka_dimensions: the shorter sizes the model was trained to be cut to
        (``config.json``'s ``matryoshka_dimensions``); empty when it was not.
    """

    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    matryoshka_dimensions: tuple[int, ...] = ()

    def allowed_dimensions(self) -> tuple[int, ...]:
        """The ``dimensions`` a request may ask for: the declared sizes and the full one."""
        return tuple(sorted({*self.matryoshka_dimensions, self.dimensions}))


def pool(
    hidden_TH: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    config: PoolingConfig,
    dimensions: list[int | None],
) -> list[torch.Tensor]:
    """One float32 vector per sequence ``i`` of the flat batch (rows ``starts[i]`` onward,
    ``lengths[i]`` of them), cut to ``dimensions[i]`` (None: full) and normalised after
    the cut where the model normalises."""
    start_N = torch.tensor(starts, device=hidden_TH.device)
    length_N = torch.tensor(lengths, device=hidden_TH.device)
    hidden = hidden_TH.float()
    if config.pooling_type == "cls":
        pooled_NH = hidden[start_N]
    elif config.pooling_type == "last":
        pooled_NH = hidden[start_N + length_N - 1]
    else:
        # Sum each sequence's rows with one index_add over the flat batch, then divide.
        seq_of_row = torch.repeat_interleave(torch.arange(len(starts)), length_N.cpu())
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        sums = torch.zeros(len(starts), hidden.shape[1], device=hidden.device)
        sums.index_add_(0, seq_of_row.to(hidden.device), hidden[rows.to(hidden.device)])
        pooled_NH = sums / length_N[:, None].to(sums.dtype)
    vectors = []
    for row, size in enumerate(dimensions):
        vector = pooled_NH[row, :size] if size is not None else pooled_NH[row]
        vectors.append(F.normalize(vector, dim=0) if config.normalize else vector)
    return vectors

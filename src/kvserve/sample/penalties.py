"""Repetition, frequency and presence penalties applied to a batch of logits.

The token lists of every row are padded into one rectangular tensor with the
pad id ``vocab_size``; scattering into ``vocab_size + 1`` columns and dropping
the last one turns the pads into no-ops, so no row needs a Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyTensors:
    """Per-row penalty values and the token ids they apply to.

    Rows whose penalty is neutral hold an empty (all-pad) token list, so they
    cost nothing but a few masked columns.
    """

    prompt_token_ids: torch.Tensor  # [N, P] long, padded with vocab_size
    output_token_ids: torch.Tensor  # [N, O] long, padded with vocab_size
    repetition_penalties: torch.Tensor  # [N] float32, 1.0 = none
    frequency_penalties: torch.Tensor  # [N] float32, 0.0 = none
    presence_penalties: torch.Tensor  # [N] float32, 0.0 = none

    def to(self, device: torch.device) -> PenaltyTensors:
        """The same tensors on ``device``."""
        return PenaltyTensors(
            prompt_token_ids=self.prompt_token_ids.to(device),
            output_token_ids=self.output_token_ids.to(device),
            repetition_penalties=self.repetition_penalties.to(device),
            frequency_penalties=self.frequency_penalties.to(device),
            presence_penalties=self.presence_penalties.to(device),
        )


def _token_counts(token_ids_NL: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary id occurs in each row, ignoring pad ids."""
    num_rows = token_ids_NL.shape[0]
    counts = torch.zeros(
        num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids_NL.device
    )  # [N, V + 1]
    ones = torch.ones_like(token_ids_NL, dtype=torch.float32)  # [N, L]
    counts.scatter_add_(1, token_ids_NL, ones)
    return counts[:, :vocab_size]  # [N, V]


def apply_penalties(logits_NV: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Return float32 logits with the penalties of ``penalties`` applied.

    Repetition (CTRL style) on tokens seen in the prompt or the output: a
    positive logit is divided by the penalty, a non-positive one multiplied.
    Frequency and presence (OpenAI style) on output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    vocab_size = logits_NV.shape[1]
    output_counts_NV = _token_counts(penalties.output_token_ids, vocab_size)
    output_seen_NV = output_counts_NV > 0
    prompt_seen_NV = _token_counts(penalties.prompt_token_ids, vocab_size) > 0

    repetition_N1 = penalties.repetition_penalties[:, None]
    seen_NV = prompt_seen_NV | output_seen_NV
    penalised_NV = torch.where(logits_NV > 0, logits_NV / repetition_N1, logits_NV * repetition_N1)
    logits_NV = torch.where(seen_NV, penalised_NV, logits_NV)

    logits_NV = logits_NV - penalties.frequency_penalties[:, None] * output_counts_NV
    return logits_NV - penalties.presence_penalties[:, None] * output_seen_NV.float()

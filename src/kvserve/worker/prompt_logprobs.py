"""Prompt logprobs: the model's log probability of each prompt token given those before it.

Normally only a prefill's last row goes through the LM head (it samples the
first generated token). A request with ``SamplingParams.prompt_logprobs``
also needs the logits of its other prompt rows; each step projects the rows
of its chunk (``input_batch.PromptLogprobRows``) and hands back their
logprobs, and the engine puts the chunks together (``engine/request_group.py``).
Steps where no request asks do none of this work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.outputs import Logprob
from kvserve.worker.input_batch import PromptLogprobRows

# Logits are projected a slice of rows at a time, so that a long chunk of a
# large-vocabulary model never holds more than this many float32 logits at once.
_MAX_LOGITS_PER_SLICE = 1 << 24


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """One step's prompt logprobs of one request.

    entries[i] belongs to prompt token ``first_token_index + i`` (always >= 1:
    the first prompt token has no logprob): that token's logprob and rank, and
    the request's top-k tokens at that position, ranked 1..k.
    """

    first_token_index: int
    entries: list[dict[int, Logprob]]


def compute_prompt_logprobs(
    hidden_TH: torch.Tensor,
    runs: tuple[PromptLogprobRows, ...],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> dict[str, PromptLogprobsChunk]:
    """The logprobs of every run of prompt rows in ``hidden_TH`` (a step's ``[T, H]``).

    compute_logits: the model's LM head, ``[N, H] -> [N, V]`` float32.
    """
    rows_per_slice = max(1, _MAX_LOGITS_PER_SLICE // vocab_size)
    chunks: dict[str, PromptLogprobsChunk] = {}
    for run in runs:
        entries: list[dict[int, Logprob]] = []
        targets_N = torch.tensor(run.target_token_ids, dtype=torch.long, device=hidden_TH.device)
        for start in range(0, len(run.target_token_ids), rows_per_slice):
            end = min(len(run.target_token_ids), start + rows_per_slice)
            logits_NV = compute_logits(hidden_TH[run.first_row + start : run.first_row + end])
            entries.extend(_slice_entries(logits_NV, targets_N[start:end], run.num_top))
        chunks[run.request_id] = PromptLogprobsChunk(run.first_position + 1, entries)
    return chunks


def _slice_entries(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, num_top: int
) -> list[dict[int, Logprob]]:
    """Each row's target logprob and rank, then its ``num_top`` most likely tokens."""
    logprobs_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    target_N1 = logprobs_NV.gather(1, targets_N[:, None])
    # Ties share the best rank, as for sampled tokens: 1 + tokens strictly more likely.
    ranks = ((logprobs_NV > target_N1).sum(dim=-1) + 1).tolist()
    values = target_N1[:, 0].tolist()
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if num_top > 0:
        top_logprobs_NK, top_ids_NK = logprobs_NV.topk(min(num_top, logprobs_NV.shape[1]), dim=-1)
        top_values, top_ids = top_logprobs_NK.tolist(), top_ids_NK.tolist()
    entries = []
    for row, target in enumerate(targets_N.tolist()):
        entry = {target: Logprob(values[row], ranks[row])}
        if num_top > 0:
            for rank, (token_id, value) in enumerate(
                zip(top_ids[row], top_values[row], strict=True), start=1
            ):
                entry.setdefault(token_id, Logprob(value, rank))
        entries.append(entry)
    return entries

"""Verifying speculative proposals: which proposed tokens a request keeps, and what follows.

A request that carries k proposals ``x_0 .. x_{k-1}`` gets k + 1 rows of
logits in its step: row j is the model's distribution for the token after
the request's tokens and ``x_0 .. x_{j-1}``. Row j is sampled exactly as the
plain sampler would sample it had the request generated ``x_0 .. x_{j-1}``
itself: its :class:`VerificationRow` stands for the request at that point
(its output tokens for the penalties and ``min_tokens``, its seeded
generator's position), so ``Sampler.target`` gives the same target
distribution ``p_j``.

Greedy rows keep the longest prefix of proposals equal to the target's
argmax, then emit the argmax of the first row that differs (or of the last
row, a bonus token): token for token the output without speculation.

Random rows use rejection sampling. The proposer is deterministic, so its
distribution ``q`` is one-hot on ``x_j``: ``x_j`` is accepted with
probability ``min(1, p_j(x_j) / q(x_j)) = p_j(x_j)``; on rejection a token is
drawn from ``normalize(max(p_j - q, 0))``, which is ``p_j`` with ``x_j``
removed. The emitted token is then distributed as ``p_j`` exactly (accepted:
``p_j(x_j)``; any other y: ``(1 - p_j(x_j)) * p_j(y) / (1 - p_j(x_j))``). The
draw is the sampler's exponential race over the unnormalised remainder.

A seeded row takes its uniform, then its exponential noise, from its own
generator (seeded from the request's seed and its output position), so a
seeded request reproduces its tokens; a row without a proposal draws exactly
as the plain sampler does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.sample.metadata import SamplingMetadata, SamplingRequest
from kvserve.sample.sampler import MIN_EXPONENTIAL, LogprobsTensors, Sampler, gather_logprobs
from kvserve.sampling_params import SamplingParams

NO_PROPOSAL = -1


@dataclass(frozen=True)
class VerificationRow:
    """A request as it stands after ``accepted`` proposals (one row of its verification).

    Satisfies :class:`~kvserve.sample.metadata.SamplingRequest`; it has no
    grammar (constrained requests are never given proposals).
    """

    request: SamplingRequest
    accepted: tuple[int, ...]

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        return [*self.request.output_token_ids, *self.accepted]

    @property
    def eos_token_ids(self) -> Sequence[int]:
        return self.request.eos_token_ids

    @property
    def seed(self) -> int | None:
        return self.request.seed

    @property
    def grammar(self) -> None:
        return None


class VerifiedRows(NamedTuple):
    """Per row of the verification logits.

    token_ids_R: [R] long, what the row emits if the request gets that far:
        its proposal when accepted, else the token drawn in its place.
    accepted_R: [R] bool, the row's proposal was accepted (False on rows
        without a proposal).
    logprobs: the raw logprobs of ``token_ids_R`` and the top ones, as the
        plain sampler reports them; None when no row asked.
    """

    token_ids_R: torch.Tensor
    accepted_R: torch.Tensor
    logprobs: LogprobsTensors | None


def verify_rows(
    sampler: Sampler,
    logits_RV: torch.Tensor,
    metadata: SamplingMetadata,
    proposals: Sequence[int],
) -> VerifiedRows:
    """Accept or replace each row's proposal (``NO_PROPOSAL`` on rows without one).

    ``metadata`` is built from the rows (:class:`VerificationRow` or plain requests).
    """
    device = logits_RV.device
    proposals_R = torch.tensor(proposals, dtype=torch.long).to(device)
    has_proposal_R = proposals_R != NO_PROPOSAL
    safe_R1 = proposals_R.clamp_min(0)[:, None]
    num_logprobs = metadata.max_num_logprobs
    raw_logprobs_RV = None if num_logprobs is None else torch.log_softmax(logits_RV.float(), -1)
    target = sampler.target(logits_RV, metadata)
    greedy_accepted_R = None
    if target.greedy_N is not None:
        greedy_accepted_R = has_proposal_R & (target.greedy_N == proposals_R)
    if target.probs_NV is None:
        assert target.greedy_N is not None and greedy_accepted_R is not None
        token_ids_R, accepted_R = target.greedy_N, greedy_accepted_R
    else:
        probs_RV = target.probs_NV
        uniform_R, exponential_RV = _draws(probs_RV, metadata, proposals, sampler.generator)
        proposal_probs_R1 = probs_RV.gather(1, safe_R1)
        accepted_R = has_proposal_R & (uniform_R < proposal_probs_R1[:, 0])
        # p with the proposal removed (rows without one write their own value back).
        kept_R1 = torch.where(has_proposal_R[:, None], 0.0, proposal_probs_R1)
        remainder_RV = probs_RV.scatter_(1, safe_R1, kept_R1)
        token_ids_R = remainder_RV.div_(exponential_RV).argmax(dim=-1)
        if target.greedy_N is not None and greedy_accepted_R is not None:
            token_ids_R = torch.where(metadata.greedy_mask, target.greedy_N, token_ids_R)
            accepted_R = torch.where(metadata.greedy_mask, greedy_accepted_R, accepted_R)
    token_ids_R = torch.where(accepted_R, proposals_R, token_ids_R)
    logprobs = None
    if raw_logprobs_RV is not None and num_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs_RV, token_ids_R, num_logprobs)
    return VerifiedRows(token_ids_R, accepted_R, logprobs)


def _draws(
    probs_RV: torch.Tensor,
    metadata: SamplingMetadata,
    proposals: Sequence[int],
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms ``[R]`` for the acceptance tests and Exp(1) noise ``[R, V]`` for the draws."""
    uniform_R = torch.zeros(probs_RV.shape[0], dtype=torch.float32, device=probs_RV.device)
    exponential_RV = torch.empty_like(probs_RV)
    if metadata.uses_global_rng:
        exponential_RV.exponential_(generator=generator)
        uniform_R.uniform_(generator=generator)
    else:
        exponential_RV.fill_(1.0)
    for row, row_generator in metadata.generators.items():
        if proposals[row] != NO_PROPOSAL:
            uniform_R[row : row + 1].uniform_(generator=row_generator)
        exponential_RV[row].exponential_(generator=row_generator)
    return uniform_R, exponential_RV.clamp_min_(MIN_EXPONENTIAL)


def num_accepted(accepted: Sequence[bool], start: int, num_proposals: int) -> int:
    """How many of the proposals in rows ``start .. start + num_proposals - 1`` are kept:
    those before the first rejected one."""
    for index in range(num_proposals):
        if not accepted[start + index]:
            return index
    return num_proposals

"""The batched sampler: logits of the rows that sample -> token ids (+ logprobs).

Order of operations, one step, all rows at once:

1. raw logprobs (``log_softmax`` of the float32 logits) if any row asked;
2. min_tokens suppression of EOS and stop ids;
3. repetition, then frequency and presence penalties;
4. greedy rows take the argmax here;
5. temperature, min_p, top_k, top_p;
6. a draw by the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)``
   picks token i with probability ``probs[i]`` (the race is won by the first of
   independent clocks with rates ``probs``), with no cumulative sum.

Seeded rows draw ``q`` from their own generator, seeded from (seed, number of
generated tokens) only; unseeded rows share one draw from the sampler's
generator (the engine seeds it from its config; None means the global RNG).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.penalties import apply_penalties
from kvserve.sample.topk_topp import apply_min_p, apply_top_k_top_p

# exponential_ may return exactly 0; clamping keeps probs / q finite
# (1 / tiny < float32 max) and never turns a zero probability into a winner.
MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


class LogprobsTensors(NamedTuple):
    """Logprobs of the raw model distribution for every row."""

    token_ids: torch.Tensor  # [N, 1 + K] long: the sampled token, then the top K
    logprobs: torch.Tensor  # [N, 1 + K] float32, top K in descending order
    sampled_ranks: torch.Tensor  # [N] long: 1 + number of tokens strictly more likely


class TargetDistribution(NamedTuple):
    """What each row samples from, after min_tokens, penalties, temperature and filters.

    greedy_N: [N] long, the greedy rows' token (the argmax after penalties);
        None when every row samples randomly.
    probs_NV: [N, V] float32, the random rows' distribution (greedy rows hold
        a distribution too, unused); None when every row is greedy.
    """

    greedy_N: torch.Tensor | None
    probs_NV: torch.Tensor | None


class SamplerOutput(NamedTuple):
    """What one step of sampling produced."""

    sampled_token_ids: torch.Tensor  # [N] long
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per row of logits according to each row's SamplingParams.

    generator: the source of randomness for rows without a seed of their own.
    argmax_rows: the greedy rows' argmax of contiguous float32 CPU logits ``[N, V]``
        (the native kernel, which PyTorch's argmax trails at large vocabularies); None:
        ``argmax(dim=-1)`` everywhere.
    """

    def __init__(
        self,
        generator: torch.Generator | None = None,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.generator = generator
        self.argmax_rows = argmax_rows

    def _argmax(self, logits_NV: torch.Tensor) -> torch.Tensor:
        fast = (
            self.argmax_rows is not None
            and logits_NV.dtype == torch.float32
            and logits_NV.device.type == "cpu"
            and logits_NV.is_contiguous()
        )
        return self.argmax_rows(logits_NV) if fast else logits_NV.argmax(dim=-1)  # type: ignore[misc]

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` [N, V] (any float dtype); outputs share its device."""
        if logits.dim() != 2 or logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits must have shape [{metadata.num_rows}, {metadata.vocab_size}] "
                f"to match the sampling metadata, got {list(logits.shape)}"
            )
        num_logprobs = metadata.max_num_logprobs
        # Raw logprobs: taken before penalties and filters change the logits.
        raw_logprobs_NV = None if num_logprobs is None else torch.log_softmax(logits.float(), -1)

        if (
            metadata.all_greedy
            and metadata.penalties is None
            and metadata.suppressed_tokens is None
        ):
            sampled_N = self._argmax(logits)
        else:
            sampled_N = self._sample(logits, metadata)

        logprobs = None
        if raw_logprobs_NV is not None and num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs_NV, sampled_N, num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled_N, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Penalties, greedy argmax, filters and the random draw; returns [N] long."""
        target = self.target(logits, metadata)
        if target.probs_NV is None:
            assert target.greedy_N is not None
            return target.greedy_N
        greedy_N, probs_NV = target.greedy_N, target.probs_NV
        exponential_NV = _exponential_draws(probs_NV, metadata, self.generator)
        random_N = probs_NV.div_(exponential_NV).argmax(dim=-1)
        if greedy_N is None:
            return random_N
        return torch.where(metadata.greedy_mask, greedy_N, random_N)

    def target(self, logits: torch.Tensor, metadata: SamplingMetadata) -> TargetDistribution:
        """Steps 2 to 5 of the module docstring: what each row samples from.

        Speculative decoding verifies proposals against exactly this (see
        ``rejection_sampler.py``), so that it samples what this sampler would.
        """
        # A private float32 copy: every step below may write in place.
        logits_NV = logits.to(torch.float32, copy=True)
        if metadata.suppressed_tokens is not None:
            suppressed = metadata.suppressed_tokens
            logits_NV[suppressed.row_ids, suppressed.token_ids] = float("-inf")
        if metadata.penalties is not None:
            logits_NV = apply_penalties(logits_NV, metadata.penalties)

        greedy_N = None if metadata.all_random else self._argmax(logits_NV)
        if metadata.all_greedy:
            return TargetDistribution(greedy_N, None)

        logits_NV.div_(metadata.temperature[:, None])
        if metadata.min_p is not None:
            apply_min_p(logits_NV, metadata.min_p)
        apply_top_k_top_p(logits_NV, metadata.top_k, metadata.top_p)
        return TargetDistribution(greedy_N, torch.softmax(logits_NV, dim=-1))


def _exponential_draws(
    probs_NV: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise [N, V]: one batched draw, then each seeded row redrawn alone.

    Greedy rows keep whatever noise they get; their token is the argmax anyway.
    """
    exponential_NV = torch.empty_like(probs_NV)
    if metadata.uses_global_rng:
        exponential_NV.exponential_(generator=generator)
    else:
        exponential_NV.fill_(1.0)  # no unseeded random row: leave the generator untouched
    # A seeded row's noise depends on its generator and V only, never on its
    # position in the batch or the other rows.
    for row, generator in metadata.generators.items():
        exponential_NV[row].exponential_(generator=generator)
    return exponential_NV.clamp_min_(MIN_EXPONENTIAL)


def gather_logprobs(
    logprobs_NV: torch.Tensor, sampled_N: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """The sampled token's logprob and rank, and the ``num_logprobs`` most likely tokens.

    ``num_logprobs`` is clamped to the vocabulary size.
    """
    sampled_N1 = sampled_N[:, None]
    sampled_logprobs_N1 = logprobs_NV.gather(1, sampled_N1)
    # Ties share the best rank: rank 1 means no token is strictly more likely.
    sampled_ranks_N = (logprobs_NV > sampled_logprobs_N1).sum(dim=-1) + 1
    num_top = min(num_logprobs, logprobs_NV.shape[1])
    top_logprobs_NK, top_token_ids_NK = logprobs_NV.topk(num_top, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled_N1, top_token_ids_NK], dim=1),
        logprobs=torch.cat([sampled_logprobs_N1, top_logprobs_NK], dim=1),
        sampled_ranks=sampled_ranks_N,
    )

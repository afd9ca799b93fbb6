"""Per-step sampling tensors, built once from the requests that sample this step.

Row ``i`` of every tensor belongs to ``requests[i]``, which is also row ``i`` of
the logits handed to the :class:`~kvserve.sample.sampler.Sampler`. Features no
row uses are ``None`` so the sampler skips their work entirely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvserve.sample.penalties import PenaltyTensors
from kvserve.sampling_params import SamplingParams

# Temperatures below this are treated as greedy, as vLLM does: dividing by a
# tiny temperature overflows float32 and sampling would be argmax anyway.
MIN_SAMPLING_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1


class SamplingRequest(Protocol):
    """What the sampler reads from one request (one row of the logits)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Tokens generated so far, before this step's sample."""
        ...

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """The model's end-of-sequence ids, suppressed while min_tokens is not reached."""
        ...

    @property
    def seed(self) -> int | None:
        """The effective per-sequence seed (derived per sequence when n > 1); None = unseeded."""
        ...


class SuppressedTokens(NamedTuple):
    """(row, token id) pairs whose logit is set to -inf before anything else."""

    row_ids: torch.Tensor  # [M] long
    token_ids: torch.Tensor  # [M] long


def _splitmix64(value: int) -> int:
    """One step of the splitmix64 mixer: a bijection on 64-bit integers."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a seeded row's draw at output position ``num_output_tokens``.

    It depends only on the request's seed and how many tokens it has generated,
    so a request samples the same tokens whatever else is in the batch, and
    again after preemption and recompute. Hashing the seed before adding the
    position keeps nearby seeds (seed, seed + 1, ... for n > 1) from sharing draws.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) + num_output_tokens)


def _pad_token_ids(rows: list[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Rows of token ids as one [N, max_len] long tensor padded with ``pad_id``."""
    tensors = [torch.tensor(list(row), dtype=torch.long) for row in rows]
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad_id)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, as tensors on the logits' device."""

    vocab_size: int
    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows so dividing is harmless
    greedy_mask: torch.Tensor  # [N] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] long in [1, V], V = disabled; None if no row uses it
    top_p: torch.Tensor | None  # [N] float32, 1.0 = disabled; None if no row uses it
    min_p: torch.Tensor | None  # [N] float32, 0.0 = disabled; None if no row uses it
    # Row index -> generator seeded for this step's draw; unseeded rows use the global RNG.
    generators: dict[int, torch.Generator]
    # Some row samples randomly without a seed; otherwise the global RNG is left untouched.
    uses_global_rng: bool
    max_num_logprobs: int | None  # largest ``logprobs`` over rows; None if no row asked
    penalties: PenaltyTensors | None
    suppressed_tokens: SuppressedTokens | None  # min_tokens suppression

    @property
    def num_rows(self) -> int:
        """N, the number of rows (requests) that sample this step."""
        return int(self.temperature.shape[0])

    @classmethod
    def from_requests(
        cls, requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """Build the step's tensors from the requests, in logits row order."""
        greedy: list[bool] = []
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        generators: dict[int, torch.Generator] = {}
        for row, request in enumerate(requests):
            params = request.sampling_params
            is_greedy = params.temperature < MIN_SAMPLING_TEMPERATURE
            greedy.append(is_greedy)
            # Filters and draws only matter on rows that sample randomly.
            temperature.append(1.0 if is_greedy else params.temperature)
            enabled_top_k = params.top_k > 0 and not is_greedy
            top_k.append(min(params.top_k, vocab_size) if enabled_top_k else vocab_size)
            top_p.append(1.0 if is_greedy else params.top_p)
            min_p.append(0.0 if is_greedy else params.min_p)
            if request.seed is not None and not is_greedy:
                generator = torch.Generator(device=device)
                generator.manual_seed(step_seed(request.seed, len(request.output_token_ids)))
                generators[row] = generator

        def to_device(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        num_logprobs = [
            r.sampling_params.logprobs for r in requests if r.sampling_params.logprobs is not None
        ]
        penalties = _build_penalties(requests, vocab_size)
        suppressed = _build_suppressed_tokens(requests, vocab_size)
        return cls(
            vocab_size=vocab_size,
            temperature=to_device(temperature, torch.float32),
            greedy_mask=to_device(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=to_device(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=to_device(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=to_device(min_p, torch.float32) if any(p > 0.0 for p in min_p) else None,
            generators=generators,
            uses_global_rng=len(generators) + sum(greedy) < len(requests),
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            penalties=penalties.to(device) if penalties is not None else None,
            suppressed_tokens=(
                SuppressedTokens(suppressed.row_ids.to(device), suppressed.token_ids.to(device))
                if suppressed is not None
                else None
            ),
        )


def _build_penalties(requests: Sequence[SamplingRequest], vocab_size: int) -> PenaltyTensors | None:
    """Penalty tensors on the CPU, or None when every row's penalties are neutral."""
    params = [request.sampling_params for request in requests]
    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    uses_output = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(uses_repetition) and not any(uses_output):
        return None
    # Token lists are only gathered for the rows that need them.
    prompt_rows = [
        r.prompt_token_ids if rep else () for r, rep in zip(requests, uses_repetition, strict=True)
    ]
    output_rows = [
        r.output_token_ids if rep or out else ()
        for r, rep, out in zip(requests, uses_repetition, uses_output, strict=True)
    ]
    return PenaltyTensors(
        prompt_token_ids=_pad_token_ids(prompt_rows, vocab_size),
        output_token_ids=_pad_token_ids(output_rows, vocab_size),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params]),
        presence_penalties=torch.tensor([p.presence_penalty for p in params]),
    )


def _build_suppressed_tokens(
    requests: Sequence[SamplingRequest], vocab_size: int
) -> SuppressedTokens | None:
    """EOS and stop ids of the rows that have not yet generated min_tokens tokens."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            continue
        banned = {*request.eos_token_ids, *(params.stop_token_ids or [])}
        # Ids outside the logits (a generation config naming an id past a
        # trimmed vocabulary) cannot be sampled anyway.
        in_vocab = sorted(t for t in banned if 0 <= t < vocab_size)
        row_ids.extend([row] * len(in_vocab))
        token_ids.extend(in_vocab)
    if not row_ids:
        return None
    return SuppressedTokens(
        torch.tensor(row_ids, dtype=torch.long), torch.tensor(token_ids, dtype=torch.long)
    )

"""The sampling of a step in which some requests verify speculative proposals.

The runner's logits have one row per plain sampling request and ``1 + k``
rows per request verifying ``k`` proposals (``input_batch.py``). Each row
gets its own sampling parameters (:class:`VerificationRow`: the request as
if the earlier proposals were generated), one pass of
:func:`~kvserve.sample.rejection_sampler.verify_rows` decides every row, and
here the rows are read back per request: the kept proposals, then one more.
Rows without proposals sample exactly as in a step without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvserve.core.request import Request
from kvserve.outputs import Logprob
from kvserve.sample import LogprobsTensors, Sampler, SamplingMetadata
from kvserve.sample.rejection_sampler import (
    NO_PROPOSAL,
    VerificationRow,
    num_accepted,
    verify_rows,
)


@dataclass
class VerifiedStep:
    """Per request: plain ones' token (and logprobs), verifying ones' emitted tokens."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


class LogitsRows(NamedTuple):
    """What each row of a step's logits samples for: ``rows[r]`` (the request, or the
    request after some proposals) and ``proposals[r]`` (``NO_PROPOSAL``: none)."""

    rows: list[Request | VerificationRow]
    proposals: list[int]


def logits_rows(requests: Sequence[Request], spec_token_ids: Sequence[list[int]]) -> LogitsRows:
    """``1 + len(spec_token_ids[i])`` rows for ``requests[i]``, in logits order."""
    rows: list[Request | VerificationRow] = []
    proposals: list[int] = []
    for request, spec in zip(requests, spec_token_ids, strict=True):
        if not spec:
            rows.append(request)
            proposals.append(NO_PROPOSAL)
            continue
        rows.extend(VerificationRow(request, tuple(spec[:j])) for j in range(len(spec) + 1))
        proposals.extend([*spec, NO_PROPOSAL])
    return LogitsRows(rows, proposals)


def sample_with_proposals(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[Request],
    spec_token_ids: Sequence[list[int]],
    rows: LogitsRows,
    vocab_size: int,
) -> VerifiedStep:
    """Sample ``logits`` [R, V], with ``rows`` from :func:`logits_rows` (grammar masks
    applied already)."""
    if logits.shape[0] != len(rows.rows):
        raise ValueError(f"expected {len(rows.rows)} rows of logits, got {logits.shape[0]}")
    proposals = rows.proposals
    metadata = SamplingMetadata.from_requests(rows.rows, vocab_size, logits.device)
    verified = verify_rows(sampler, logits, metadata, proposals)
    token_ids = verified.token_ids_R.tolist()
    accepted = verified.accepted_R.tolist()
    entries = _logprob_entries(verified.logprobs, rows.rows)
    step = VerifiedStep()
    start = 0
    for request, spec in zip(requests, spec_token_ids, strict=True):
        request_id = request.request_id
        if not spec:
            step.sampled_token_ids[request_id] = token_ids[start]
            entry = entries[start]
            if entry is not None:
                step.logprobs[request_id] = entry
            start += 1
            continue
        end = start + num_accepted(accepted, start, len(spec)) + 1
        step.verified_token_ids[request_id] = token_ids[start:end]
        if request.sampling_params.logprobs is not None:
            step.verified_logprobs[request_id] = [e for e in entries[start:end] if e is not None]
        start += len(spec) + 1
    return step


def _logprob_entries(
    logprobs: LogprobsTensors | None, rows: Sequence[Request | VerificationRow]
) -> list[dict[int, Logprob] | None]:
    """Per row: its token's logprob and rank, then the top ones (None: not asked)."""
    if logprobs is None:
        return [None] * len(rows)
    ids = logprobs.token_ids.tolist()
    values = logprobs.logprobs.tolist()
    ranks = logprobs.sampled_ranks.tolist()
    entries: list[dict[int, Logprob] | None] = []
    for row, request in enumerate(rows):
        num_top = request.sampling_params.logprobs
        if num_top is None:
            entries.append(None)
            continue
        entry = {ids[row][0]: Logprob(values[row][0], ranks[row])}
        for rank, column in enumerate(range(1, num_top + 1), start=1):
            entry.setdefault(ids[row][column], Logprob(values[row][column], rank))
        entries.append(entry)
    return entries

"""Verification of speculative proposals, with fake requests and no model.

The references are computed here independently: the target distribution by
hand (softmax of the tempered, top-k filtered, penalised logits), the greedy
answer by a plain argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.sample import Sampler, SamplingMetadata
from kvserve.sample.rejection_sampler import (
    NO_PROPOSAL,
    VerificationRow,
    num_accepted,
    verify_rows,
)
from kvserve.sampling_params import SamplingParams

VOCAB = 6


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit test: the chance of a statistic this large if ``observed``
    were drawn from ``expected`` (its upper tail, k - 1 degrees of freedom, through the
    regularized incomplete gamma function)."""
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees = torch.tensor(float(len(observed) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(degrees / 2, statistic.double() / 2))


@dataclass
class FakeRequest:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


def two_row_batch(
    requests: list[FakeRequest], proposal: int, logits_2V: torch.Tensor
) -> tuple[list[VerificationRow], list[int], torch.Tensor]:
    """Each request verifies one proposal: its row 0 checks it, row 1 is the bonus row."""
    rows = [VerificationRow(r, accepted) for r in requests for accepted in ((), (proposal,))]
    proposals = [proposal, NO_PROPOSAL] * len(requests)
    return rows, proposals, logits_2V.repeat(len(requests), 1)


def reference_probs(logits_V: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits_V.double() / temperature
    kth = scaled.sort(descending=True).values[top_k - 1]
    return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)


def test_emitted_tokens_follow_the_target_distribution() -> None:
    torch.manual_seed(0)
    logits_2V = torch.randn(2, VOCAB) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    num_requests = 40_000
    proposal = int(reference_probs(logits_2V[0], 0.8, 5).argsort()[-2])  # often, not always, kept
    rows, proposals, logits = two_row_batch(
        [FakeRequest(params) for _ in range(num_requests)], proposal, logits_2V
    )
    metadata = SamplingMetadata.from_requests(rows, VOCAB, logits.device)
    sampler = Sampler(torch.Generator().manual_seed(1234))
    verified = verify_rows(sampler, logits, metadata, proposals)
    tokens = verified.token_ids_R.view(num_requests, 2)
    accepted = verified.accepted_R.view(num_requests, 2)
    assert not accepted[:, 1].any()  # the bonus row has nothing to accept
    assert torch.equal(accepted[:, 0], tokens[:, 0] == proposal)

    first_expected = reference_probs(logits_2V[0], 0.8, 5) * num_requests
    first_counts = torch.bincount(tokens[:, 0], minlength=VOCAB).double()
    support = first_expected > 0
    assert first_counts[~support].sum() == 0  # top-k's dropped token never appears
    assert chi_square_p_value(first_counts[support], first_expected[support]) > 1e-3

    # After an accepted proposal, the bonus token follows row 1's distribution.
    bonus = tokens[accepted[:, 0], 1]
    bonus_expected = reference_probs(logits_2V[1], 0.8, 5) * len(bonus)
    bonus_counts = torch.bincount(bonus, minlength=VOCAB).double()
    support = bonus_expected > 0
    assert bonus_counts[~support].sum() == 0
    assert chi_square_p_value(bonus_counts[support], bonus_expected[support]) > 1e-3


def test_the_p_value_matches_tabulated_chi_square_quantiles() -> None:
    """Upper-tail quantiles from statistics tables: P(X > 11.070) = 0.05 at 5 degrees of
    freedom, P(X > 9.210) = 0.01 at 2."""
    for statistic, degrees, tail in ((11.0705, 5, 0.05), (9.2103, 2, 0.01)):
        # One cell carries the whole statistic: (o - e)^2 / e with e = 1.
        observed = torch.ones(degrees + 1, dtype=torch.float64)
        observed[0] += statistic**0.5
        expected = torch.ones(degrees + 1, dtype=torch.float64)
        assert abs(chi_square_p_value(observed, expected) - tail) < 1e-4


def test_chi_square_would_notice_a_sampler_that_ignores_the_target() -> None:
    """The check above can fail: always keeping the proposal is far from the target."""
    torch.manual_seed(0)
    logits_V = torch.randn(VOCAB) * 1.5
    expected = reference_probs(logits_V, 0.8, 5) * 10_000
    always_proposal = torch.zeros(VOCAB, dtype=torch.float64)
    always_proposal[int(expected.argmax())] = 10_000
    support = expected > 0
    assert chi_square_p_value(always_proposal[support], expected[support]) < 1e-6


def test_greedy_keeps_the_prefix_equal_to_the_argmax() -> None:
    logits = torch.tensor(
        [[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0], [2.0, 0.0, 0.0]]
    )  # argmax per row: 1, 0, 2, 0
    request = FakeRequest(SamplingParams(temperature=0.0))
    rows = [VerificationRow(request, (1, 0, 1)[:j]) for j in range(4)]
    metadata = SamplingMetadata.from_requests(rows, 3, logits.device)
    verified = verify_rows(Sampler(), logits, metadata, [1, 0, 1, NO_PROPOSAL])
    accepted = verified.accepted_R.tolist()
    assert accepted == [True, True, False, False]
    assert num_accepted(accepted, 0, 3) == 2
    # Two proposals kept, then the argmax of the row that disagreed.
    assert verified.token_ids_R.tolist()[:3] == [1, 0, 2]


def test_penalties_see_the_accepted_proposals() -> None:
    """Row j is penalised as if the first j proposals were already generated."""
    logits = torch.tensor([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9]])
    request = FakeRequest(SamplingParams(temperature=0.0, presence_penalty=0.5))
    rows = [VerificationRow(request, ()), VerificationRow(request, (1,))]
    metadata = SamplingMetadata.from_requests(rows, 3, logits.device)
    verified = verify_rows(Sampler(), logits, metadata, [1, NO_PROPOSAL])
    # Token 1 is kept at row 0; at row 1 it was "generated" already and loses to token 2.
    assert verified.token_ids_R.tolist() == [1, 2]


def test_seeded_requests_reproduce_their_tokens() -> None:
    torch.manual_seed(3)
    logits_2V = torch.randn(2, VOCAB)

    def run(seed: int) -> list[int]:
        requests = [FakeRequest(SamplingParams(temperature=1.0), seed=seed + i) for i in range(50)]
        rows, proposals, logits = two_row_batch(requests, 2, logits_2V)
        metadata = SamplingMetadata.from_requests(rows, VOCAB, logits.device)
        # A fresh global generator each time: seeded rows must not depend on it.
        sampler = Sampler(torch.Generator().manual_seed(seed * 7 + 1))
        return verify_rows(sampler, logits, metadata, proposals).token_ids_R.tolist()

    assert run(10) == run(10)
    assert run(10) != run(11)


def test_logprobs_are_those_of_the_emitted_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    request = FakeRequest(SamplingParams(temperature=0.0, logprobs=1))
    rows = [VerificationRow(request, ()), VerificationRow(request, (1,))]
    metadata = SamplingMetadata.from_requests(rows, 3, logits.device)
    verified = verify_rows(Sampler(), logits, metadata, [1, NO_PROPOSAL])
    assert verified.logprobs is not None
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(verified.logprobs.logprobs[:, 0], expected[[0, 1], [1, 0]])

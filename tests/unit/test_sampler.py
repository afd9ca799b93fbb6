"""The batched sampler against per-row references, with fake requests and no model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sample import Sampler, SamplerOutput, SamplingMetadata
from kvserve.sample.penalties import apply_penalties
from kvserve.sampling_params import SamplingParams


@dataclass
class FakeRequest:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


def run_sampler(logits: torch.Tensor, requests: list[FakeRequest]) -> SamplerOutput:
    metadata = SamplingMetadata.from_requests(requests, logits.shape[1], logits.device)
    return Sampler()(logits, metadata)


def sample_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """``num_draws`` independent samples of one row, drawn as one batch."""
    logits = logits_row.expand(num_draws, -1).clone()
    return run_sampler(logits, [FakeRequest(params) for _ in range(num_draws)]).sampled_token_ids


def empirical_distribution(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(token_ids, minlength=vocab_size).double()
    return counts / counts.sum()


# --- greedy -----------------------------------------------------------------


def test_greedy_rows_take_argmax_of_any_float_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=generator)
    requests = [FakeRequest(SamplingParams(temperature=0.0)) for _ in range(8)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        output = run_sampler(logits.to(dtype), requests)
        assert output.sampled_token_ids.dtype == torch.long
        assert torch.equal(output.sampled_token_ids, logits.to(dtype).float().argmax(dim=-1))
        assert output.logprobs is None


def test_greedy_rows_take_argmax_in_a_batch_with_sampled_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 50) * 0.1  # flat: sampled rows rarely hit the argmax
    requests = [
        FakeRequest(SamplingParams(temperature=0.0 if row % 2 == 0 else 1.0, top_k=40))
        for row in range(16)
    ]
    sampled_rows_hit_argmax = 0
    for _ in range(10):
        sampled = run_sampler(logits, requests).sampled_token_ids
        argmax = logits.argmax(dim=-1)
        assert torch.equal(sampled[0::2], argmax[0::2])
        sampled_rows_hit_argmax += int((sampled[1::2] == argmax[1::2]).sum())
    assert sampled_rows_hit_argmax < 40  # the sampled rows really sampled


def test_greedy_and_seeded_batches_leave_the_global_rng_alone() -> None:
    logits = torch.randn(4, 100)
    greedy = [FakeRequest(SamplingParams(temperature=0.0)) for _ in range(2)]
    seeded = [FakeRequest(SamplingParams(), seed=row) for row in range(2)]
    state = torch.get_rng_state()
    run_sampler(logits, greedy + seeded)
    assert torch.equal(torch.get_rng_state(), state)


# --- temperature and filters --------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_sampling_matches_softmax_of_scaled_logits(temperature: float) -> None:
    torch.manual_seed(2)
    logits = torch.linspace(0.0, 3.0, 8)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    sampled = sample_many(logits, SamplingParams(temperature=temperature), 20_000)
    total_variation = 0.5 * (empirical_distribution(sampled, 8) - expected).abs().sum()
    assert total_variation < 0.02


def test_seeded_rows_sample_the_right_distribution() -> None:
    logits = torch.linspace(0.0, 3.0, 8)
    expected = torch.softmax(logits.double() / 0.8, dim=-1)
    num_draws = 10_000
    requests = [
        FakeRequest(SamplingParams(temperature=0.8), seed=seed) for seed in range(num_draws)
    ]
    sampled = run_sampler(logits.expand(num_draws, -1).clone(), requests).sampled_token_ids
    total_variation = 0.5 * (empirical_distribution(sampled, 8) - expected).abs().sum()
    assert total_variation < 0.03


@pytest.mark.parametrize("companion_top_p", [1.0, 0.9])  # 0.9 takes the sort path
def test_top_k_never_samples_outside_the_top_k(companion_top_p: float) -> None:
    torch.manual_seed(3)
    vocab_size = 60
    logits = torch.randn(3, vocab_size)
    top_ks = [5, 1, -1]
    requests = [FakeRequest(SamplingParams(temperature=5.0, top_k=k)) for k in top_ks]
    companion = FakeRequest(SamplingParams(temperature=5.0, top_p=companion_top_p))
    batch = torch.cat([logits, torch.randn(1, vocab_size)])
    seen: list[set[int]] = [set() for _ in top_ks]
    for _ in range(300):
        sampled = run_sampler(batch, [*requests, companion]).sampled_token_ids
        for row in range(len(top_ks)):
            seen[row].add(int(sampled[row]))
    assert seen[0] == set(logits[0].topk(5).indices.tolist())  # all of the top 5, nothing else
    assert seen[1] == {int(logits[1].argmax())}
    assert len(seen[2]) > 30  # top_k=-1 keeps the whole vocabulary


def _log_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits whose softmax puts probs[i] on token order[i]."""
    logits = torch.full((len(probs),), 0.0)
    for prob, token_id in zip(probs, order, strict=True):
        logits[token_id] = math.log(prob)
    return logits


@pytest.mark.parametrize(
    ("top_p", "nucleus_size"), [(0.75, 2), (0.85, 3), (0.1, 1), (0.45, 1), (1.0, 5)]
)
def test_top_p_samples_exactly_the_nucleus(top_p: float, nucleus_size: int) -> None:
    torch.manual_seed(4)
    order = [3, 0, 4, 1, 2]  # token ids from most to least likely
    logits = _log_probs([0.5, 0.3, 0.1, 0.06, 0.04], order)
    sampled = sample_many(logits, SamplingParams(top_p=top_p), 4000)
    assert set(sampled.tolist()) == set(order[:nucleus_size])


def test_top_p_and_top_k_combine() -> None:
    torch.manual_seed(5)
    order = [3, 0, 4, 1, 2]
    logits = _log_probs([0.5, 0.3, 0.1, 0.06, 0.04], order)
    # Alone, top_p=0.85 needs 0.5 + 0.3 + 0.1. After top_k=3 the kept tokens are
    # renormalised to 0.556/0.333/0.111, so 0.85 needs two and 0.9 all three.
    sampled = sample_many(logits, SamplingParams(top_p=0.85), 4000)
    assert set(sampled.tolist()) == set(order[:3])
    sampled = sample_many(logits, SamplingParams(top_k=3, top_p=0.85), 4000)
    assert set(sampled.tolist()) == set(order[:2])
    sampled = sample_many(logits, SamplingParams(top_k=3, top_p=0.9), 4000)
    assert set(sampled.tolist()) == set(order[:3])


@pytest.mark.parametrize(("min_p", "kept"), [(0.3, 3), (0.0, 5), (0.9, 1), (0.2, 4)])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_one(min_p: float, kept: int) -> None:
    torch.manual_seed(6)
    order = [2, 4, 0, 3, 1]
    logits = _log_probs([0.4, 0.3, 0.15, 0.1, 0.05], order)
    sampled = sample_many(logits, SamplingParams(min_p=min_p), 4000)
    assert set(sampled.tolist()) == set(order[:kept])


# --- seeds ----------------------------------------------------------------------


def _step_logits(step: int, vocab_size: int) -> torch.Tensor:
    """The fake model's logits for one request at one step: flat enough to vary."""
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 + step)) * 0.5


def _generate(batch_size: int, row: int, num_steps: int, global_seed: int) -> list[int]:
    """Run the seeded request at ``row`` among unseeded and other-seeded rows."""
    torch.manual_seed(global_seed)
    vocab_size = 500
    target = FakeRequest(SamplingParams(temperature=1.0, top_p=0.95), seed=1234)
    others = [
        FakeRequest(SamplingParams(temperature=1.0), seed=other if other % 2 else None)
        for other in range(batch_size - 1)
    ]
    for _ in range(num_steps):
        requests = [*others[:row], target, *others[row:]]
        logits = torch.randn(batch_size, vocab_size)
        logits[row] = _step_logits(len(target.output_token_ids), vocab_size)
        sampled = run_sampler(logits, requests).sampled_token_ids
        target.output_token_ids.append(int(sampled[row]))
        for other in others:
            other.output_token_ids.append(0)
    return target.output_token_ids


def test_seeded_request_samples_the_same_tokens_whatever_the_batch() -> None:
    alone = _generate(batch_size=1, row=0, num_steps=12, global_seed=0)
    assert _generate(batch_size=5, row=3, num_steps=12, global_seed=1) == alone
    assert _generate(batch_size=3, row=0, num_steps=12, global_seed=2) == alone
    assert len(set(alone)) > 6  # the sequence is not stuck on one token


def test_seeded_request_resumes_identically_after_recompute() -> None:
    full = _generate(batch_size=2, row=1, num_steps=10, global_seed=0)
    # Preempted after 6 tokens: the engine recomputes and continues from there.
    vocab_size = 500
    resumed = FakeRequest(SamplingParams(temperature=1.0, top_p=0.95), seed=1234)
    resumed.output_token_ids = full[:6]
    torch.manual_seed(99)
    for _ in range(4):
        logits = _step_logits(len(resumed.output_token_ids), vocab_size)[None]
        resumed.output_token_ids.append(int(run_sampler(logits, [resumed]).sampled_token_ids[0]))
    assert resumed.output_token_ids == full


def test_same_seed_draws_differently_at_each_output_position() -> None:
    logits = torch.zeros(20, 1000)  # uniform: the token is the draw
    requests = [
        FakeRequest(SamplingParams(), output_token_ids=[0] * length, seed=7) for length in range(20)
    ]
    sampled = run_sampler(logits, requests).sampled_token_ids
    assert len(set(sampled.tolist())) >= 18
    again = run_sampler(logits, list(reversed(requests))).sampled_token_ids
    assert torch.equal(again, sampled.flip(0))
    other_seed = [FakeRequest(SamplingParams(), seed=8) for _ in range(1)]
    assert run_sampler(logits[:1], other_seed).sampled_token_ids[0] != sampled[0]


# --- min_tokens -----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_suppresses_eos_and_stop_ids_until_reached(temperature: float) -> None:
    vocab_size = 20
    eos_id, stop_id = 3, 5
    logits = torch.zeros(1, vocab_size)
    logits[0, eos_id] = 50.0
    logits[0, stop_id] = 40.0
    params = SamplingParams(temperature=temperature, min_tokens=4, stop_token_ids=[stop_id])
    for num_generated in range(4):
        request = FakeRequest(params, output_token_ids=[7] * num_generated, eos_token_ids=[eos_id])
        for _ in range(20):
            token = int(run_sampler(logits, [request]).sampled_token_ids[0])
            assert token not in (eos_id, stop_id)
    reached = FakeRequest(params, output_token_ids=[7] * 4, eos_token_ids=[eos_id])
    assert int(run_sampler(logits, [reached]).sampled_token_ids[0]) == eos_id


def test_min_tokens_applies_per_row() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 2] = 50.0
    params = SamplingParams(temperature=0.0, min_tokens=2)
    requests = [
        FakeRequest(params, output_token_ids=[1], eos_token_ids=[2]),
        FakeRequest(params, output_token_ids=[1, 1], eos_token_ids=[2]),
    ]
    assert run_sampler(logits, requests).sampled_token_ids.tolist() == [0, 2]


# --- penalties ------------------------------------------------------------------


def reference_penalties(logits: list[float], request: FakeRequest) -> list[float]:
    """Per-token loop implementation of the three penalties."""
    params = request.sampling_params
    result = []
    for token_id, logit in enumerate(logits):
        value = logit
        if token_id in request.prompt_token_ids or token_id in request.output_token_ids:
            if value > 0:
                value /= params.repetition_penalty
            else:
                value *= params.repetition_penalty
        count = request.output_token_ids.count(token_id)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (1.0 if count > 0 else 0.0)
        result.append(value)
    return result


penalty_requests = st.builds(
    FakeRequest,
    sampling_params=st.builds(
        SamplingParams,
        temperature=st.just(0.0),
        repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
        frequency_penalty=st.sampled_from([0.0, -1.5, 0.4, 2.0]),
        presence_penalty=st.sampled_from([0.0, -0.7, 1.0]),
    ),
    prompt_token_ids=st.lists(st.integers(0, 11), max_size=8),
    output_token_ids=st.lists(st.integers(0, 11), max_size=8),
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(penalty_requests, min_size=1, max_size=4),
    data=st.data(),
)
def test_penalties_match_per_row_reference(
    requests: list[FakeRequest], data: st.DataObject
) -> None:
    vocab_size = 12
    logit_values = st.floats(-5.0, 5.0, allow_nan=False, width=32)
    rows = [
        data.draw(st.lists(logit_values, min_size=vocab_size, max_size=vocab_size))
        for _ in requests
    ]
    logits = torch.tensor(rows)
    expected = torch.tensor(
        [reference_penalties(row, r) for row, r in zip(rows, requests, strict=True)]
    )
    metadata = SamplingMetadata.from_requests(requests, vocab_size, logits.device)
    if metadata.penalties is not None:
        torch.testing.assert_close(apply_penalties(logits, metadata.penalties), expected)
    else:
        torch.testing.assert_close(logits, expected)
    # Greedy rows take the argmax of the penalised logits.
    sampled = Sampler()(logits, metadata).sampled_token_ids
    chosen = expected.gather(1, sampled[:, None])[:, 0]
    torch.testing.assert_close(chosen, expected.max(dim=-1).values)


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.5)
    run_sampler(logits, [FakeRequest(params, prompt_token_ids=[1, 2])] * 2)
    assert torch.equal(logits, before)


# --- logprobs -------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution_with_sorted_top_k_and_ranks() -> None:
    torch.manual_seed(8)
    vocab_size = 40
    logits = torch.randn(5, vocab_size, dtype=torch.float64).to(torch.bfloat16)
    asked = [None, 0, 3, 5, 2]
    requests = [
        FakeRequest(
            SamplingParams(temperature=1.5, top_k=10, logprobs=k, repetition_penalty=1.7),
            prompt_token_ids=[0, 1, 2],
        )
        for k in asked
    ]
    output = run_sampler(logits, requests)
    assert output.logprobs is not None
    token_ids, logprobs, ranks = output.logprobs
    assert token_ids.shape == (5, 6) and logprobs.shape == (5, 6) and ranks.shape == (5,)
    assert logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(token_ids[:, 0], output.sampled_token_ids)
    for row in range(5):
        torch.testing.assert_close(logprobs[row], raw[row, token_ids[row]])
        top = logprobs[row, 1:]
        assert torch.all(top[:-1] >= top[1:])
        torch.testing.assert_close(top, raw[row].sort(descending=True).values[:5])
        sampled_logprob = raw[row, output.sampled_token_ids[row]]
        expected_rank = 1 + sum(1 for value in raw[row].tolist() if value > sampled_logprob)
        assert int(ranks[row]) == expected_rank


def test_greedy_sample_has_rank_one_and_no_logprobs_unless_asked() -> None:
    logits = torch.randn(3, 25)
    greedy = [FakeRequest(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(3)]
    output = run_sampler(logits, greedy)
    assert output.logprobs is not None
    assert output.logprobs.token_ids.shape == (3, 1)
    assert output.logprobs.sampled_ranks.tolist() == [1, 1, 1]
    assert run_sampler(logits, [FakeRequest(SamplingParams())] * 3).logprobs is None


def test_logits_of_the_wrong_shape_are_refused() -> None:
    metadata = SamplingMetadata.from_requests(
        [FakeRequest(SamplingParams())], 10, torch.device("cpu")
    )
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(torch.zeros(2, 10), metadata)


# --- property: the sampled token survives every filter ----------------------------


def reference_allowed_tokens(logits: list[float], params: SamplingParams) -> set[int]:
    """Tokens the filters may keep, with a little slack for float rounding (a superset)."""
    values = torch.tensor(logits, dtype=torch.float64) / params.temperature
    probs = torch.softmax(values, dim=-1).tolist()
    scaled = values.tolist()
    allowed = [i for i, p in enumerate(probs) if p >= params.min_p * max(probs) * (1 - 1e-4)]
    if params.top_k > 0:
        ranked = sorted((scaled[i] for i in allowed), reverse=True)
        kth = ranked[min(params.top_k, len(ranked)) - 1]
        allowed = [i for i in allowed if scaled[i] >= kth - 1e-4]
    if params.top_p < 1.0:
        total = sum(probs[i] for i in allowed)
        by_prob = sorted(allowed, key=lambda i: probs[i], reverse=True)
        cumulative, last_prob = 0.0, 0.0
        for i in by_prob:
            cumulative += probs[i] / total
            last_prob = probs[i]
            if cumulative >= params.top_p + 1e-4:
                break
        allowed = [i for i in allowed if probs[i] >= last_prob * (1 - 1e-4)]
    return set(allowed)


row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.floats(-8.0, 8.0, width=32), min_size=10, max_size=10),
            row_params,
            st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_sampled_token_always_survives_the_filters(
    rows: list[tuple[list[float], SamplingParams, int | None]],
) -> None:
    logits = torch.tensor([row_logits for row_logits, _, _ in rows])
    requests = [FakeRequest(params, seed=seed) for _, params, seed in rows]
    sampled = run_sampler(logits, requests).sampled_token_ids.tolist()
    for (row_logits, params, _), token in zip(rows, sampled, strict=True):
        if params.temperature == 0.0:
            assert row_logits[token] == max(row_logits)
        else:
            assert token in reference_allowed_tokens(row_logits, params)

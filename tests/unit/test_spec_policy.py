"""Adaptive speculation (core/spec_policy.py): proposals only where they pay on this machine.

The policy is fed step costs as a machine would show them: nearly flat in the
row count while a step streams the weights (a few sequences), proportional to
the rows once it computes (many sequences). It must speculate in the first
regime, stop in the second, and start again when load falls; each request's
own acceptance must count.
"""

from __future__ import annotations

import pytest
from test_spec_scheduler import make_request, make_scheduler, run_all, run_step

from kvserve.config import SpeculativeConfig
from kvserve.core.spec_policy import (
    COST_HORIZON,
    MIN_GAIN,
    MIN_SAMPLES,
    PROBE_EVERY,
    SpeculationPolicy,
    expected_accepted,
)
from kvserve.errors import InvalidParameterError


def test_expected_accepted_is_the_geometric_sum() -> None:
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.0, 4) == 0


def observe(policy: SpeculationPolicy, rows: int, seconds: float) -> None:
    """As many steps as make a row count known."""
    for _ in range(MIN_SAMPLES):
        policy.observe_step(rows, seconds)


def test_costs_are_measured_interpolated_and_extrapolated() -> None:
    policy = SpeculationPolicy()
    assert policy.cost(4) is None
    policy.observe_step(2, 0.010)
    assert policy.cost(2) is None  # one step is not enough to know a count
    observe(policy, 2, 0.010)
    assert policy.cost(9) == 0.010  # one count known: flat above it
    assert policy.cost(1) == pytest.approx(0.005)  # and in proportion below it
    observe(policy, 6, 0.014)
    assert policy.cost(4) == pytest.approx(0.012)  # between two: interpolated
    assert policy.cost(10) == pytest.approx(0.018)  # past them: the last slope carried
    policy.observe_step(6, 0.500)  # one slow step among them moves nothing: the fastest
    assert policy.cost(6) == pytest.approx(0.014)


def test_a_slow_first_step_does_not_rule_a_row_count_out() -> None:
    policy = SpeculationPolicy()
    observe(policy, 1, 0.010)
    policy.observe_step(6, 0.050)  # a first use: five times the cost
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 5  # still estimated from 1 row: tried again


def test_one_fast_step_is_the_cost_of_a_count_first_measured_slow() -> None:
    policy = SpeculationPolicy()
    observe(policy, 1, 0.010)
    observe(policy, 6, 0.030)  # the first steps: cold caches, kernels tuning
    policy.observe_step(6, 0.012)  # a probe once warm
    assert policy.cost(6) == pytest.approx(0.012)


def one_stream_step(policy: SpeculationPolicy) -> int:
    """The proposals one decoding request gets in a step of its own."""
    policy.begin_step(1)
    return policy.num_proposals("a", 5)


def test_a_declining_policy_probes_now_and_then() -> None:
    policy = SpeculationPolicy()
    for rows in range(1, 8):
        observe(policy, rows, 0.010 * rows)  # every row costs a whole step
    grants = [one_stream_step(policy) for _ in range(PROBE_EVERY)]
    assert grants.count(0) == PROBE_EVERY - 1 and grants[-1] == 5


def test_a_policy_granting_less_than_the_limit_probes_the_limit() -> None:
    policy = SpeculationPolicy()
    for rows in range(1, 7):
        observe(policy, rows, 0.010 if rows <= 3 else 0.100)  # three proposals pay, more not
    grants = [one_stream_step(policy) for _ in range(PROBE_EVERY)]
    assert grants[:-1] == [2] * (PROBE_EVERY - 1) and grants[-1] == 5
    assert policy.num_declined == 0  # proposals were granted: nothing was declined


def test_a_stale_cost_is_measured_again_and_then_chosen() -> None:
    policy = SpeculationPolicy()
    observe(policy, 1, 0.010)
    observe(policy, 6, 0.060)  # measured while the machine was busy
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) < 5
    for _ in range(COST_HORIZON):
        policy.observe_step(1, 0.010)  # time passes: the six-row samples are stale
    policy.observe_step(6, 0.0105)  # a probe: the old samples go, one is not enough to know
    assert policy.cost(6) == pytest.approx(0.010)  # estimated from one row again
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 5  # so tried
    observe(policy, 6, 0.0105)
    assert policy.cost(6) == pytest.approx(0.0105)  # and known afresh
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 5


def test_fresh_samples_are_kept() -> None:
    policy = SpeculationPolicy()
    observe(policy, 6, 0.020)
    for _ in range(COST_HORIZON // 2):
        policy.observe_step(1, 0.010)
    policy.observe_step(6, 0.020)  # within the horizon: the earlier ones still count
    assert policy.cost(6) == pytest.approx(0.020)


def flat_then_steep() -> SpeculationPolicy:
    """Rows cost almost nothing up to 8 (weights streamed once), then 3 ms each."""
    policy = SpeculationPolicy()
    for rows in (1, 2, 4, 6, 8):
        observe(policy, rows, 0.010 + 0.0001 * rows)
    for rows in (32, 36, 40):
        observe(policy, rows, 0.003 * rows)
    return policy


def test_it_speculates_while_rows_are_cheap_and_stops_under_load() -> None:
    policy = flat_then_steep()
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 5  # one stream: the rows are nearly free
    policy.begin_step(32)
    assert policy.num_proposals("a", 5) == 0  # 32 streams: five rows cost 15% of the step
    assert policy.num_declined == 1
    policy.begin_step(2)
    assert policy.num_proposals("a", 5) > 0  # load fell: again


def test_rows_granted_earlier_in_a_step_count_for_later_requests() -> None:
    policy = flat_then_steep()
    policy.begin_step(4)
    grants = []
    for name in "abcdefgh":
        k = policy.num_proposals(name, 5)
        policy.add_rows(k)
        grants.append(k)
    assert grants[0] > 0 and grants[-1] == 0  # the step fills the cheap rows, then stops


def test_a_large_batch_probes_once_in_so_many_steps_not_decisions() -> None:
    """A probe's rows slow every request of the step: 32 streams probe no more often than one."""
    policy = SpeculationPolicy()
    for rows in range(1, 80):
        observe(policy, rows, 0.002 * rows)  # compute-bound: no proposal pays
    grants = []
    for _ in range(2 * PROBE_EVERY):
        policy.begin_step(32)
        for name in range(32):
            k = policy.num_proposals(str(name), 5)
            policy.add_rows(k)
            grants.append(k)
    assert grants.count(5) == 2 and grants.count(0) == len(grants) - 2


def test_under_load_fewer_rows_than_any_measured_are_not_taken_as_free() -> None:
    """Under load every step holds 32 rows and their proposals, so only larger counts get
    measured; the batch's own count, below all of them, must not look as dear as the
    fewest measured (extra rows would then look free and be granted for good)."""
    policy = SpeculationPolicy()
    for rows in range(40, 72):
        observe(policy, rows, 0.010 + 0.001 * rows)  # 1 ms a row on top of 10 ms
    for _ in range(20):
        policy.observe_verification("a", 5, 2)  # 40% kept
    policy.begin_step(32)
    assert policy.num_proposals("a", 5) == 0  # 2 ms more for 0.6 tokens on 32: no
    assert policy.cost(32) == pytest.approx(0.050 * 32 / 40)
    policy.observe_step(32, 0.042)
    observe(policy, 32, 0.042)
    assert policy.cost(36) == pytest.approx(0.042 + 4 * (0.050 - 0.042) / 8)  # now between two


def grants_of_one_step(policy: SpeculationPolicy, batch: int) -> list[int]:
    policy.begin_step(batch)
    grants = []
    for name in range(batch):
        k = policy.num_proposals(str(name), 5)
        policy.add_rows(k)
        grants.append(k)
    return grants


def test_past_the_rows_measured_one_request_a_step_finds_out() -> None:
    """Before anything is measured, and past the most rows measured, costs are guesses: a
    batch of 32 acting on them at once would quadruple its step."""
    policy = SpeculationPolicy()
    assert grants_of_one_step(policy, 32) == [5] + [0] * 31
    observe(policy, 32, 0.040)
    assert grants_of_one_step(policy, 32) == [5] + [0] * 31  # 37 rows guessed as cheap as 32
    observe(policy, 42, 0.0401)  # (as a step of 42 finds) nearly so
    grants = grants_of_one_step(policy, 32)
    assert grants[:3] == [5, 5, 5] and grants[3:] == [0] * 29  # two inside 42, one past
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 0  # load fell below what is known: measure it
    observe(policy, 1, 0.010)
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) > 0  # and speculate again


def test_each_requests_acceptance_counts() -> None:
    policy = SpeculationPolicy()
    for rows in (1, 2, 3, 4, 5, 6):
        observe(policy, rows, 0.010 * (1 + 0.1 * (rows - 1)))  # each row costs 10%
    for _ in range(20):
        policy.observe_verification("copying", 5, 5)
        policy.observe_verification("inventing", 5, 0)
    assert policy.acceptance("copying") > 0.9 and policy.acceptance("inventing") < 0.1
    policy.begin_step(1)
    assert policy.num_proposals("copying", 5) == 5
    assert policy.num_proposals("inventing", 5) == 0
    policy.forget("inventing")
    assert policy.acceptance("inventing") == policy.acceptance("someone new")


def test_the_scheduler_asks_the_policy_and_outputs_do_not_change() -> None:
    """Under a cost model that makes every proposal row expensive, the scheduler verifies
    none after the policy has seen it; the tokens stay those of the plain scheduler."""
    plain = [make_request(f"r{i}", 9 + 5 * i, 20) for i in range(4)]
    run_all(make_scheduler(False), plain)

    scheduler = make_scheduler(True)
    assert scheduler.spec_policy is not None
    for rows in range(1, 40):
        observe(scheduler.spec_policy, rows, 0.010 * rows)  # compute-bound everywhere
    adaptive = [make_request(f"r{i}", 9 + 5 * i, 20) for i in range(4)]
    run_all(scheduler, adaptive)
    for want, got in zip(plain, adaptive, strict=True):
        assert got.output_token_ids == want.output_token_ids
    # Declined every time but for a probe in each PROBE_EVERY steps (k = 4 each).
    declined = scheduler.num_spec_declined_total
    assert declined > 0
    assert scheduler.num_spec_proposed_total <= 4 * (declined // (PROBE_EVERY - 1) + 1)


def test_a_grant_must_promise_more_than_break_even() -> None:
    """Under load with high acceptance every request sits near break-even; a gain smaller
    than the cost model's accuracy is declined, a clear one granted."""
    policy = SpeculationPolicy()
    for _ in range(40):
        policy.observe_verification("a", 5, 5)  # everything kept
    acceptance = policy.acceptance("a")

    def one_more_row_gains(gain: float) -> None:
        """16 rows cost 16 ms; a 17th raises tokens per second by ``gain``, and every
        further row costs a whole step's share."""
        observe(policy, 17, 0.016 * (16 + acceptance) / 16 / (1 + gain))

    observe(policy, 16, 0.016)
    one_more_row_gains(MIN_GAIN / 2)
    for rows in range(18, 24):
        observe(policy, rows, 0.0015 * rows)
    policy.begin_step(16)
    assert policy.num_proposals("a", 5) == 0
    assert policy.num_declined == 1
    one_more_row_gains(2 * MIN_GAIN)  # the fastest of a count's steps is its cost
    policy.begin_step(16)
    assert policy.num_proposals("a", 5) == 1


def test_a_step_computing_prompt_tokens_gets_no_proposals_not_even_a_probe() -> None:
    policy = SpeculationPolicy()
    for rows in range(1, 8):
        observe(policy, rows, 0.010)  # rows free in decode-only steps
    for _ in range(2 * PROBE_EVERY):
        policy.begin_step(1, computes_prompts=True)
        assert policy.num_proposals("a", 5) == 0
    assert policy.num_declined == 2 * PROBE_EVERY
    policy.begin_step(1)
    assert policy.num_proposals("a", 5) == 5  # the next decode-only step speculates


def test_the_scheduler_proposes_nothing_in_a_step_that_admits_a_request() -> None:
    scheduler = make_scheduler(True, budget=256)
    assert scheduler.spec_policy is not None
    for rows in range(1, 40):
        observe(scheduler.spec_policy, rows, 0.010)  # rows free: always worth proposing
    scheduler.add_request(make_request("a", 9, 40))
    for _ in range(4):
        run_step(scheduler)  # its prompt, then decode steps that verify proposals
    output, _ = run_step(scheduler)
    assert any(item.spec_token_ids for item in output.scheduled)
    scheduler.add_request(make_request("b", 30, 10))
    output, _ = run_step(scheduler)  # b's prompt beside a's decode
    assert {item.request.request_id for item in output.scheduled} == {"a", "b"}
    assert not any(item.spec_token_ids for item in output.scheduled)
    output, _ = run_step(scheduler)  # both decode: proposals again
    assert any(item.spec_token_ids for item in output.scheduled)


def test_the_step_time_reaches_the_policy_only_for_decode_only_steps() -> None:
    scheduler = make_scheduler(True)
    assert scheduler.spec_policy is not None
    scheduler.add_request(make_request("r", 9, 10))
    output, _ = run_step(scheduler)  # the prompt: not a decode step
    scheduler.observe_step_time(output, 0.5)
    assert scheduler.spec_policy.cost(1) is None
    assert not scheduler.spec_policy._samples  # the prompt's step taught it nothing
    for _ in range(MIN_SAMPLES):
        output, _ = run_step(scheduler)
        scheduler.observe_step_time(output, 0.02)
    assert sum(len(steps) for steps in scheduler.spec_policy._samples.values()) == MIN_SAMPLES


def test_adaptive_is_a_boolean_and_false_turns_the_policy_off() -> None:
    with pytest.raises(InvalidParameterError, match=r"speculative_config\.adaptive"):
        SpeculativeConfig(adaptive="yes")  # type: ignore[arg-type]
    assert SpeculativeConfig.from_value({"adaptive": False}).adaptive is False  # type: ignore[union-attr]
    assert make_scheduler(False).spec_policy is None

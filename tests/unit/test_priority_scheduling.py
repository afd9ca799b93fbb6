"""The priority policy, with a fake model: every sampling request gets token 7."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus, check_priority_and_salt
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

FAKE_TOKEN = 7


def make_scheduler(
    policy: str = "priority", num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        policy=policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching=True), 4096)


def make_request(name: str, priority: int, prompt_len: int = 8, max_tokens: int = 8) -> Request:
    # Distinct prompts: these tests are about the policy, not about cache hits.
    prompt = [1000 * (1 + sum(map(ord, name))) + i for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(name, prompt, params, priority=priority)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {item.request.request_id: FAKE_TOKEN for item in output.scheduled if item.samples}
    scheduler.update_from_output(output, sampled)
    return output


def names(output: SchedulerOutput) -> list[str]:
    return [item.request.request_id for item in output.scheduled]


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    for name, priority in (("low-1", 5), ("low-2", 5), ("mid", 3), ("high", 0)):
        scheduler.add_request(make_request(name, priority, max_tokens=1))
    order = []
    while scheduler.has_unfinished_requests():
        order += names(run_step(scheduler))
    assert order == ["high", "mid", "low-1", "low-2"]


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(policy="fcfs", max_num_seqs=1)
    for name, priority in (("first", 5), ("second", 0)):
        scheduler.add_request(make_request(name, priority, max_tokens=1))
    assert names(run_step(scheduler)) == ["first"]


def test_a_late_high_priority_request_preempts_a_low_priority_one_when_memory_is_short() -> None:
    # 7 usable blocks of 4 tokens; each low-priority request holds 3 after its first decode.
    scheduler = make_scheduler(num_blocks=8)
    low_old, low_new = make_request("low-old", 5), make_request("low-new", 5)
    scheduler.add_request(low_old)
    scheduler.add_request(low_new)
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    waiting_low = make_request("waiting-low", 5)
    scheduler.add_request(waiting_low)
    high = make_request("high", 0, max_tokens=4)
    scheduler.add_request(high)
    output = run_step(scheduler)
    # "high" needs 2 blocks: the newest low-priority request makes room. It rejoins the queue
    # ahead of "waiting-low" (same priority, earlier arrival), so "waiting-low" cannot jump it.
    assert output.num_preempted == 1
    assert low_new.status == RequestStatus.PREEMPTED
    assert low_old.status == RequestStatus.RUNNING
    assert "high" in names(output) and "waiting-low" not in names(output)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert high.output_token_ids == [FAKE_TOKEN] * 4
    for request in (low_old, low_new, waiting_low):
        assert request.output_token_ids == [FAKE_TOKEN] * 8
    assert scheduler.kv_cache_manager.num_free_blocks == 7


def test_a_late_high_priority_request_takes_the_seat_of_a_low_priority_one() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    low = make_request("low", 5)
    scheduler.add_request(low)
    run_step(scheduler)
    scheduler.add_request(make_request("high", 0))
    output = run_step(scheduler)
    assert names(output) == ["high"]
    assert low.status == RequestStatus.PREEMPTED


def test_equal_priority_never_preempts_to_admit() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    first = make_request("first", 2)
    scheduler.add_request(first)
    run_step(scheduler)
    scheduler.add_request(make_request("second", 2))
    output = run_step(scheduler)
    assert names(output) == ["first"] and output.num_preempted == 0


@pytest.mark.parametrize(("policy", "victim"), [("priority", "old"), ("fcfs", "new")])
def test_running_requests_short_of_blocks_preempt_by_policy(policy: str, victim: str) -> None:
    # The older request has the larger priority value (less important): the policies disagree.
    scheduler = make_scheduler(policy=policy, num_blocks=5)  # 4 usable blocks
    old, new = make_request("old", 5), make_request("new", 0)
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted = []
    while scheduler.has_unfinished_requests():
        if run_step(scheduler).num_preempted:
            preempted += [r.request_id for r in (old, new) if r.status == RequestStatus.PREEMPTED]
    assert preempted and preempted[0] == victim
    assert old.output_token_ids == new.output_token_ids == [FAKE_TOKEN] * 8


def test_priority_and_salt_are_checked() -> None:
    check_priority_and_salt(3, "salt", "priority")
    check_priority_and_salt(0, None, "fcfs")
    with pytest.raises(InvalidParameterError, match="priority"):
        check_priority_and_salt(1, None, "fcfs")
    with pytest.raises(InvalidParameterError, match="priority"):
        check_priority_and_salt(True, None, "priority")
    with pytest.raises(InvalidParameterError, match="cache_salt"):
        check_priority_and_salt(0, "", "priority")
    with pytest.raises(InvalidParameterError, match="cache_salt"):
        check_priority_and_salt(0, 5, "priority")

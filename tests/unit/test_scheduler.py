"""Scheduler behaviour with a fake model: every sampling request gets token 7."""

from __future__ import annotations

import random

from kvserve.config import SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling_params import SamplingParams

EOS = 2
FAKE_TOKEN = 7


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_num_seqs: int = 8,
    chunked: bool = True,
    max_model_len: int = 4096,
    prefill_cap: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        max_prefill_tokens_while_decoding=prefill_cap,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size), max_model_len)


def make_request(
    request_id: str, prompt_len: int, max_tokens: int = 8, **params: object
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(request_id, list(range(10, 10 + prompt_len)), sampling, eos_token_ids=(EOS,))


def run_step(
    scheduler: Scheduler, token: int = FAKE_TOKEN
) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    sampled = {item.request.request_id: token for item in output.scheduled if item.samples}
    return output, scheduler.update_from_output(output, sampled)


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in output.scheduled}


def test_budget_and_seat_limits_hold_every_step_and_all_requests_finish() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=200, budget=24, max_num_seqs=5)
    requests = [make_request(f"r{i}", rng.randint(1, 60), rng.randint(1, 12)) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        assert output.total_num_scheduled_tokens <= 24
        assert len(output.scheduled) <= 5
        assert scheduler.num_running <= 5
        steps += 1
        assert steps < 1000
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [FAKE_TOKEN] * request.sampling_params.max_tokens
    assert (
        scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_usable_blocks
    )


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    scheduler = make_scheduler(budget=16)
    old = make_request("old", 10)
    scheduler.add_request(old)
    run_step(scheduler)  # prefills "old" whole and samples its first token
    scheduler.add_request(make_request("long", 100))
    output, _ = run_step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["old", "long"]
    assert scheduled_tokens(output) == {"old": 1, "long": 15}


def test_decode_goes_first_even_when_an_older_request_is_still_prefilling() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("prefilling", 40))
    scheduler.add_request(make_request("short", 2))
    run_step(scheduler)  # 8 tokens of "prefilling"
    scheduler.finish_requests(["prefilling"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("late-long", 40))
    run_step(scheduler)  # "short" prefills (2), "late-long" gets 6
    output, _ = run_step(scheduler)
    assert output.scheduled[0].request.request_id == "short"
    assert scheduled_tokens(output) == {"short": 1, "late-long": 7}


def test_prefill_beside_decodes_is_capped_and_takes_the_whole_budget_alone() -> None:
    scheduler = make_scheduler(budget=32, prefill_cap=6)
    scheduler.add_request(make_request("a", 40, max_tokens=20))
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 32}  # nothing decodes yet: the whole budget
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 8}  # still no decode: the rest of the prompt
    scheduler.add_request(make_request("b", 10))
    scheduler.add_request(make_request("c", 10))
    # "a" decodes now: the two prompts share 6 tokens, in arrival order, step after step.
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 1, "b": 6}
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 1, "b": 4, "c": 2}
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 1, "b": 1, "c": 6}


def test_the_prefill_cap_holds_through_preemptions_and_every_request_finishes() -> None:
    rng = random.Random(1)
    # Few blocks, so that requests are preempted and recomputed along the way.
    scheduler = make_scheduler(num_blocks=12, budget=24, max_num_seqs=6, prefill_cap=5)
    requests = [make_request(f"r{i}", rng.randint(1, 30), rng.randint(1, 12)) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        # A one-token chunk (a prompt's last token) costs what a decode does: not capped.
        chunks = [item.num_new_tokens for item in output.scheduled if item.num_new_tokens > 1]
        if any(item.is_decode for item in output.scheduled):
            assert sum(chunks) <= 5
        assert output.total_num_scheduled_tokens <= 24
        steps += 1
        assert steps < 2000
    assert scheduler.num_preemptions_total > 0
    for request in requests:
        assert request.output_token_ids == [FAKE_TOKEN] * request.sampling_params.max_tokens
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_long_prompt_is_split_into_chunks_and_samples_only_at_the_end() -> None:
    scheduler = make_scheduler(budget=32)
    request = make_request("long", 70, max_tokens=3)
    scheduler.add_request(request)
    chunks = []
    for _ in range(3):
        output, _ = run_step(scheduler)
        chunks.append((output.scheduled[0].num_new_tokens, output.scheduled[0].samples))
    assert chunks == [(32, False), (32, False), (6, True)]
    assert request.num_computed_tokens == 70
    assert request.output_token_ids == [FAKE_TOKEN]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(budget=32, chunked=False)
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20))
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 20}
    output, _ = run_step(scheduler)
    assert scheduled_tokens(output) == {"a": 1, "b": 20}


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    scheduler = make_scheduler(budget=100, max_num_seqs=2)
    for name in ("first", "second", "third"):
        scheduler.add_request(make_request(name, 5))
    output, _ = run_step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["first", "second"]
    assert [r.request_id for r in scheduler.waiting] == ["third"]


def test_preemption_takes_the_newest_request_and_requeues_it_first_with_its_tokens() -> None:
    # 1 null + 6 usable blocks of 4 tokens. Three requests of 8 prompt tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=7, block_size=4, budget=64)
    requests = [make_request(name, 8, max_tokens=20) for name in ("a", "b", "c")]
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler)  # all prefilled: each has 9 tokens, 8 computed, pool full
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    output, _ = run_step(scheduler)  # "a" needs a third block: "c" is preempted
    newest = requests[2]
    assert output.num_preempted == 1
    assert newest.status == RequestStatus.PREEMPTED
    assert scheduler.waiting.peek() is newest
    assert newest.num_computed_tokens == 0
    assert newest.output_token_ids == [FAKE_TOKEN]  # generated tokens are kept
    assert newest.num_preemptions == 1
    assert scheduler.kv_cache_manager.num_held_blocks("c") == 0
    assert set(scheduled_tokens(output)) == {"a", "b"}


def test_preempted_request_resumes_and_finishes_with_all_its_tokens() -> None:
    scheduler = make_scheduler(num_blocks=7, block_size=4, budget=64)
    requests = [make_request(name, 8, max_tokens=6) for name in ("a", "b", "c")]
    for request in requests:
        scheduler.add_request(request)
    total_preempted = 0
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        total_preempted += output.num_preempted
    assert total_preempted >= 1
    for request in requests:
        assert request.output_token_ids == [FAKE_TOKEN] * 6
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_the_newest_request_preempts_itself_when_it_alone_needs_a_block() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, budget=64)  # 4 usable blocks
    old, new = make_request("old", 4, 12), make_request("new", 7, 12)
    scheduler.add_request(old)
    run_step(scheduler)
    scheduler.add_request(new)
    for _ in range(3):  # the second decode of "new" needs its third block; none is free
        output, _ = run_step(scheduler)
        if output.num_preempted:
            break
    assert output.num_preempted == 1
    assert new.status == RequestStatus.PREEMPTED
    assert old.status == RequestStatus.RUNNING
    assert scheduled_tokens(output) == {"old": 1}


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=20, block_size=4)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("queued", 10))
    run_step(scheduler)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks < manager.num_usable_blocks
    aborted = scheduler.finish_requests(["a", "queued", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["a", "queued"]
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty


def test_eos_stops_unless_ignored_and_not_before_min_tokens() -> None:
    scheduler = make_scheduler()
    plain = make_request("plain", 3)
    ignoring = make_request("ignoring", 3, max_tokens=4, ignore_eos=True)
    patient = make_request("patient", 3, min_tokens=2)
    for request in (plain, ignoring, patient):
        scheduler.add_request(request)
    run_step(scheduler, token=EOS)
    assert plain.status == RequestStatus.FINISHED_STOPPED
    assert patient.status == RequestStatus.RUNNING  # 1 token < min_tokens
    run_step(scheduler, token=EOS)
    assert patient.status == RequestStatus.FINISHED_STOPPED
    assert patient.output_token_ids == [EOS, EOS]
    while scheduler.has_unfinished_requests():
        run_step(scheduler, token=EOS)
    assert ignoring.status == RequestStatus.FINISHED_LENGTH
    assert ignoring.num_output_tokens == 4


def test_stop_token_ids_end_the_request_and_are_recorded() -> None:
    scheduler = make_scheduler()
    request = make_request("r", 3, stop_token_ids=[FAKE_TOKEN])
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == FAKE_TOKEN


def test_request_stops_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=12)
    request = make_request("r", 10, max_tokens=100)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 12

"""The scheduler over a hybrid KV cache (sliding-window and global groups), fake model."""

from __future__ import annotations

import random

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.core.stats import collect_stats
from kvserve.sampling_params import SamplingParams

FAKE_TOKEN = 7
# A tiny Gemma 3: five sliding groups with a 32-token window, one global group.
GEMMA3_LIKE = (32,) * 5 + (None,)


def make_scheduler(
    num_blocks: int, block_size: int, windows: tuple[int | None, ...], budget: int = 64
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8)
    manager = KVCacheManager(num_blocks, block_size, sliding_windows=windows)
    return Scheduler(config, manager, max_model_len=4096)


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(range(10, 10 + prompt_len)), params)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {item.request.request_id: FAKE_TOKEN for item in output.scheduled if item.samples}
    scheduler.update_from_output(output, sampled)
    return output


def test_a_2048_token_sequence_holds_the_window_in_sliding_groups_and_everything_in_global() -> (
    None
):
    block_size, window = 16, 32
    # Full history in all six groups would take 6 x 128 blocks; this pool has 128 + 5 x 7.
    scheduler = make_scheduler(128 + 5 * 7 + 1, block_size, GEMMA3_LIKE)
    manager = scheduler.kv_cache_manager
    request = make_request("long", 100, 2048 - 100)
    scheduler.add_request(request)
    decode_bound = -(-window // block_size) + 1  # 3
    prefill_bound = -(-(window - 1 + 64) // block_size) + 1  # 7: the window and a 64-token chunk
    max_sliding_in_decode = 0
    while scheduler.has_unfinished_requests():
        output = run_step(scheduler)
        assert output.num_preempted == 0
        [item] = output.scheduled
        # The step's tables: one per group, positional, nulls only before the window.
        assert len(item.block_ids) == 6
        num_positions = request.num_computed_tokens
        for table in item.block_ids:
            assert len(table) == -(-num_positions // block_size)
        for table in item.block_ids[:5]:
            num_null = table.count(NULL_BLOCK_ID)
            assert table[:num_null] == [NULL_BLOCK_ID] * num_null
        if request.is_finished:
            break
        *sliding, full = manager.num_held_blocks_per_group("long")
        assert full == -(-request.num_computed_tokens // block_size)
        bound = decode_bound if item.is_decode else prefill_bound
        assert max(sliding) <= bound
        if item.is_decode:
            max_sliding_in_decode = max(max_sliding_in_decode, *sliding)
    assert request.num_tokens == 2048 and request.status == RequestStatus.FINISHED_LENGTH
    assert max_sliding_in_decode == decode_bound
    assert full == 128  # held until the step that samples the 2048th token
    assert manager.num_free_blocks == manager.num_usable_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_under_memory_pressure_all_finish_and_return_every_block(
    seed: int,
) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(40, 4, (8, None, 8), budget=24)
    requests = [make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 30)) for i in range(12)]
    pending = list(requests)
    preempted = 0
    for _ in range(3000):
        if not (pending or scheduler.has_unfinished_requests()):
            break
        for _ in range(rng.randint(0, 2)):
            if pending:
                scheduler.add_request(pending.pop(0))
        output = run_step(scheduler)
        preempted += output.num_preempted
        manager = scheduler.kv_cache_manager
        held = sum(manager.num_held_blocks(r.request_id) for r in scheduler.running)
        assert held + manager.num_free_blocks == manager.num_usable_blocks
        assert all(manager.num_held_blocks(r.request_id) == 0 for r in scheduler.waiting)
        stats = collect_stats(scheduler, output, 0)
        assert stats.num_blocks_used == held
    else:
        raise AssertionError("requests did not finish")
    assert preempted >= 1
    for request in requests:
        assert request.output_token_ids == [FAKE_TOKEN] * request.sampling_params.max_tokens
    assert scheduler.kv_cache_manager.num_free_blocks == 39


def test_abort_frees_every_group() -> None:
    scheduler = make_scheduler(64, 4, (8, None))
    manager = scheduler.kv_cache_manager
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 30, 20))
    for _ in range(5):
        run_step(scheduler)
    assert all(min(manager.num_held_blocks_per_group(n)) > 0 for n in ("a", "b"))
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert manager.num_held_blocks_per_group("a") == (0, 0)
    assert manager.num_free_blocks == manager.num_usable_blocks

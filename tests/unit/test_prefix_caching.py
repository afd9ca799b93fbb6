"""Prefix caching in the scheduler and KV cache manager, with a fake model (every sample is 7)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.block_hash import extend_block_hashes, hash_block_tokens
from kvserve.core.block_pool import BlockPool
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerOutput
from kvserve.core.stats import collect_stats
from kvserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
FAKE_TOKEN = 7


def make_scheduler(num_blocks: int = 64, budget: int = 64, caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
    return Scheduler(config, manager, max_model_len=4096)


def make_request(
    request_id: str, prompt: list[int], max_tokens: int = 4, cache_salt: str | None = None
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, cache_salt=cache_salt)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {item.request.request_id: FAKE_TOKEN for item in output.scheduled if item.samples}
    scheduler.update_from_output(output, sampled)
    return output


def run_to_end(scheduler: Scheduler) -> None:
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            return
        run_step(scheduler)
    raise AssertionError("requests did not finish")


def scheduled(output: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_new_tokens for item in output.scheduled}


PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks of 4 and 2 more


# ------------------------------------------------------------------ hashing


def test_block_hash_is_sha256_of_a_stable_encoding() -> None:
    # A fixed value: Python's salted hash() would change from process to process.
    digest = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert len(digest) == 32
    assert digest.hex()[:16] == "e6300283a602d37b"


def test_block_hash_covers_parent_tokens_and_salt() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert hash_block_tokens(first, [5, 6, 7, 8], None) != hash_block_tokens(
        None, [5, 6, 7, 8], None
    )
    assert hash_block_tokens(None, [1, 2, 3, 4], "a") != first
    assert hash_block_tokens(None, [1, 2, 3, 4], "a") != hash_block_tokens(None, [1, 2, 3, 4], "b")
    assert hash_block_tokens(None, [1, 2, 3, 4], "a") == hash_block_tokens(None, [1, 2, 3, 4], "a")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 4, None)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7], None)


def test_a_hash_match_with_other_tokens_is_not_a_hit() -> None:
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 32, [1, 2, 3, 4])
    assert pool.get_cached_block(b"h" * 32, [1, 2, 3, 4]) is block
    assert pool.get_cached_block(b"h" * 32, [1, 2, 3, 5]) is None


# ------------------------------------------------------------------ hits


def test_a_repeated_prompt_takes_its_full_blocks_from_the_cache() -> None:
    scheduler = make_scheduler()
    first = make_request("first", PROMPT)
    scheduler.add_request(first)
    run_to_end(scheduler)
    second = make_request("second", PROMPT)
    scheduler.add_request(second)
    output = run_step(scheduler)
    # 5 full blocks (20 tokens) come from the cache; the last 2 tokens are computed.
    assert scheduled(output) == {"second": 2}
    assert second.output_token_ids == [FAKE_TOKEN]
    manager = scheduler.kv_cache_manager
    assert manager.prefix_cache_hits == 20
    assert manager.prefix_cache_queries == 44


def test_a_block_aligned_prompt_recomputes_its_last_block_into_a_block_it_owns() -> None:
    scheduler = make_scheduler()
    prompt = PROMPT[:20]
    scheduler.add_request(make_request("first", prompt, max_tokens=1))
    run_to_end(scheduler)
    cached_ids = set(scheduler.kv_cache_manager.block_pool.free_block_ids())
    second = make_request("second", prompt, max_tokens=1)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert scheduled(output) == {"second": 4}
    assert output.scheduled[0].samples
    (block_ids,) = output.scheduled[0].block_ids
    assert len(block_ids) == 5
    last_block = scheduler.kv_cache_manager.block_pool.blocks[block_ids[-1]]
    assert last_block.ref_cnt == 1 and last_block.block_hash is None
    assert set(block_ids[:4]) <= cached_ids


def test_a_hit_ending_mid_prompt_computes_the_rest_after_it() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", PROMPT, max_tokens=1))
    run_to_end(scheduler)
    branch = PROMPT[:10] + [999] * 12  # shares 2 full blocks, diverges inside the third
    second = make_request("second", branch)
    scheduler.add_request(second)
    output = run_step(scheduler)
    assert scheduled(output) == {"second": 14}
    assert output.scheduled[0].request.num_computed_tokens == 22


def test_shared_blocks_are_counted_once_per_holder_and_survive_one_holder_ending() -> None:
    scheduler = make_scheduler()
    first = make_request("first", PROMPT, max_tokens=8)
    scheduler.add_request(first)
    run_step(scheduler)
    second = make_request("second", PROMPT, max_tokens=8)
    scheduler.add_request(second)
    run_step(scheduler)
    manager = scheduler.kv_cache_manager
    shared = manager.get_block_ids("first")[0][:5]
    assert manager.get_block_ids("second")[0][:5] == shared
    assert all(manager.block_pool.blocks[b].ref_cnt == 2 for b in shared)
    # Nothing past the shared prefix is shared: each request writes only its own blocks.
    assert not set(manager.get_block_ids("first")[0][5:]) & set(
        manager.get_block_ids("second")[0][5:]
    )
    scheduler.finish_requests(["first"], RequestStatus.FINISHED_ABORTED)
    assert all(manager.block_pool.blocks[b].ref_cnt == 1 for b in shared)
    run_to_end(scheduler)
    assert second.output_token_ids == [FAKE_TOKEN] * 8
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_generated_tokens_are_cached_once_their_block_is_computed() -> None:
    scheduler = make_scheduler()
    first = make_request("first", PROMPT[:6], max_tokens=8)
    scheduler.add_request(first)
    run_to_end(scheduler)
    # 6 prompt + 8 generated tokens; 13 are computed (the last sampled token never is).
    follow_up = make_request("follow-up", [*first.all_token_ids, 555, 556])
    scheduler.add_request(follow_up)
    output = run_step(scheduler)
    assert scheduled(output) == {"follow-up": 16 - 12}


def test_sequences_submitted_together_share_the_prompt_computed_by_the_first() -> None:
    scheduler = make_scheduler(budget=64)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, PROMPT))
    output = run_step(scheduler)
    # b and c would recompute blocks "a" computes in this very step: they wait one step.
    assert scheduled(output) == {"a": 22}
    output = run_step(scheduler)
    assert scheduled(output) == {"a": 1, "b": 2, "c": 2}
    assert scheduler.kv_cache_manager.prefix_cache_hits == 40


def test_a_preempted_request_finds_its_own_blocks_again() -> None:
    scheduler = make_scheduler(num_blocks=9)  # 8 usable blocks
    manager = scheduler.kv_cache_manager
    old = make_request("old", PROMPT[:12], max_tokens=12)
    new = make_request("new", list(range(300, 312)), max_tokens=12)
    scheduler.add_request(old)
    scheduler.add_request(new)
    table_before: list[int] = []
    for _ in range(40):
        (table_before,) = manager.get_block_ids("new")
        if run_step(scheduler).num_preempted:
            break
    assert new.status == RequestStatus.PREEMPTED
    hits_before = manager.prefix_cache_hits
    while new.status != RequestStatus.RUNNING:
        run_step(scheduler)
    # "old" reused the blocks "new" freed last (its tail); its first blocks were still cached.
    num_hit_blocks = (manager.prefix_cache_hits - hits_before) // BLOCK_SIZE
    assert num_hit_blocks >= 2
    assert manager.get_block_ids("new")[0][:num_hit_blocks] == table_before[:num_hit_blocks]
    run_to_end(scheduler)
    assert new.output_token_ids == [FAKE_TOKEN] * 12
    assert old.output_token_ids == [FAKE_TOKEN] * 12


def test_different_cache_salts_never_share_blocks_and_equal_ones_do() -> None:
    scheduler = make_scheduler()
    requests = [
        make_request("a1", PROMPT, cache_salt="tenant-a"),
        make_request("b", PROMPT, cache_salt="tenant-b"),
        make_request("none", PROMPT),
        make_request("a2", PROMPT, cache_salt="tenant-a"),
    ]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler)
    manager = scheduler.kv_cache_manager
    tables = {r.request_id: set(manager.get_block_ids(r.request_id)[0]) for r in requests}
    assert not tables["a1"] & tables["b"]
    assert not tables["a1"] & tables["none"]
    assert not tables["b"] & tables["none"]
    assert len(tables["a1"] & tables["a2"]) == 5
    assert manager.prefix_cache_hits == 20


def test_without_caching_nothing_is_cached_or_looked_up() -> None:
    scheduler = make_scheduler(caching=False)
    scheduler.add_request(make_request("first", PROMPT))
    run_to_end(scheduler)
    scheduler.add_request(make_request("second", PROMPT))
    assert scheduled(run_step(scheduler)) == {"second": 22}
    manager = scheduler.kv_cache_manager
    assert manager.num_cached_blocks == 0
    assert manager.prefix_cache_queries == 0


def test_stats_report_blocks_hits_and_the_prefill_decode_split() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("first", PROMPT, max_tokens=1))
    run_to_end(scheduler)
    scheduler.add_request(make_request("decoding", PROMPT[:3], max_tokens=4))
    run_step(scheduler)
    scheduler.add_request(make_request("second", PROMPT))
    output = run_step(scheduler)
    stats = collect_stats(scheduler, output, num_steps=5)
    assert (stats.num_scheduled_tokens, stats.num_prefill_tokens, stats.num_decode_tokens) == (
        3,
        2,
        1,
    )
    assert stats.num_running == 2 and stats.num_waiting == 0
    assert stats.num_blocks_used + stats.num_blocks_free == stats.num_blocks_total == 63
    # PROMPT's 5 full blocks, and the first block of "decoding" (3 prompt + 1 generated token).
    assert stats.num_blocks_cached == 6
    assert stats.prefix_cache_hits == 20
    assert stats.prefix_cache_queries == 22 + 3 + 22
    assert 0 < stats.prefix_cache_hit_rate < 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(4))
def test_random_shared_workloads_under_memory_pressure_all_finish(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.choice([8, 16, 64])
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, policy=policy)  # type: ignore[arg-type]
    # 23 usable blocks for 30 requests of up to 48 tokens: preemptions are certain.
    scheduler = Scheduler(config, KVCacheManager(24, BLOCK_SIZE, enable_caching=True), 4096)
    requests = []
    for index in range(30):
        prompt = PROMPT[: rng.randint(1, 22)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        request = make_request(f"r{index}", prompt, max_tokens=rng.randint(1, 20))
        request.priority = rng.randint(0, 3) if policy == "priority" else 0
        requests.append(request)
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        run_step(scheduler)
        pool = scheduler.kv_cache_manager.block_pool
        holders = Counter(
            b
            for r in scheduler.running
            for b in scheduler.kv_cache_manager.get_block_ids(r.request_id)[0]
        )
        assert all(pool.blocks[b].ref_cnt == count for b, count in holders.items())
        steps += 1
        assert steps < 2000
    for request in requests:
        assert request.output_token_ids == [FAKE_TOKEN] * request.sampling_params.max_tokens
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.prefix_cache_hits > 0
    assert scheduler.num_preemptions_total > 0

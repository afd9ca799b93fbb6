"""KV block bookkeeping stays consistent under any sequence of operations."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

NUM_BLOCKS = 24
BLOCK_SIZE = 4

# (operation, request slot, token count)
operations = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "free", "abort"]),
        st.integers(min_value=0, max_value=5),
        st.integers(min_value=1, max_value=30),
    ),
    max_size=60,
)


def check_invariants(manager: KVCacheManager, live: dict[str, Request]) -> None:
    pool = manager.block_pool
    owners: Counter[int] = Counter()
    for request_id in live:
        (table,) = manager.get_block_ids(request_id)
        owners.update(table)
    assert NULL_BLOCK_ID not in owners
    # Without sharing, no block has two owners, and ref_cnt equals the number of owners.
    assert all(count == 1 for count in owners.values())
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == owners[block.block_id]
    assert pool.num_free_blocks + len(owners) == pool.num_usable_blocks
    # Every request holds exactly the blocks its computed tokens need.
    for request_id, request in live.items():
        assert manager.num_held_blocks(request_id) == -(-request.num_computed_tokens // BLOCK_SIZE)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_blocks_are_never_owned_twice_and_all_return_when_requests_end(ops: list) -> None:
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    live: dict[str, Request] = {}
    for op, slot, num_tokens in ops:
        request_id = f"r{slot}"
        request = live.get(request_id)
        if op == "allocate" and request is None:
            request = Request(request_id, [1] * num_tokens, SamplingParams())
            if manager.allocate_slots(request, num_tokens) is not None:
                request.num_computed_tokens = num_tokens
                live[request_id] = request
            else:
                assert manager.num_held_blocks(request_id) == 0
        elif op == "append" and request is not None:
            free_before = manager.num_free_blocks
            new_blocks = manager.allocate_slots(request, num_tokens)
            if new_blocks is None:
                assert manager.num_free_blocks == free_before  # a failed allocation changes nothing
            else:
                request.num_computed_tokens += num_tokens
        elif op in ("free", "abort") and request is not None:
            manager.free(request)
            del live[request_id]
        check_invariants(manager, live)
    for request in list(live.values()):
        manager.free(request)
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_freeing_a_block_twice_is_caught() -> None:
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def cache(pool: BlockPool, block: KVBlock) -> None:
    """Enter ``block`` into the prefix cache under a hash of its own id."""
    assert pool.cache_block(block, block.block_id.to_bytes(8, "little"), [block.block_id])


def test_written_blocks_without_a_hash_are_reused_before_never_written_ones() -> None:
    pool = BlockPool(7)  # blocks 1..6
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    pool.free_blocks([pool.blocks[1], pool.blocks[3]])
    # Most recently freed first, then the never-written blocks 4, 5, 6 in id order.
    assert pool.free_block_ids() == [3, 1, 4, 5, 6]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 1, 4, 5]


def test_cached_blocks_wait_behind_never_written_ones_and_are_evicted_lru() -> None:
    pool = BlockPool(8)  # blocks 1..7
    blocks = pool.get_new_blocks(4)  # 1..4
    for block in blocks:
        cache(pool, block)
    pool.free_blocks([pool.blocks[3], pool.blocks[1]])
    pool.free_blocks([pool.blocks[4]])
    # Never-written 5..7 first, then the cached ones in the order they were freed.
    assert pool.free_block_ids() == [5, 6, 7, 3, 1, 4]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [5, 6, 7, 3]
    assert pool.blocks[3].block_hash is None  # evicted on reuse
    assert pool.blocks[1].block_hash is not None  # still cached
    # A cache hit takes a free cached block out of the order.
    pool.touch([pool.blocks[1]])
    assert pool.free_block_ids() == [4]


def test_an_uncached_block_freed_later_is_reused_before_cached_ones() -> None:
    pool = BlockPool(4)  # blocks 1..3
    first, second, third = pool.get_new_blocks(3)
    cache(pool, first)
    pool.free_blocks([first])
    pool.free_blocks([third, second])  # uncached: second freed last
    assert pool.free_block_ids() == [2, 3, 1]


def test_blocks_a_cache_reset_forgets_are_reused_before_never_written_ones() -> None:
    pool = BlockPool(7)  # blocks 1..6
    blocks = pool.get_new_blocks(3)  # 1..3
    for block in blocks[1:]:
        cache(pool, block)
    pool.free_blocks([pool.blocks[3], pool.blocks[1], pool.blocks[2]])
    assert pool.free_block_ids() == [1, 4, 5, 6, 3, 2]
    assert pool.reset_prefix_cache()
    # Already reusable block 1, then the forgotten ones in their old eviction order.
    assert pool.free_block_ids() == [1, 3, 2, 4, 5, 6]
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)
    assert [b.block_id for b in pool.get_new_blocks(6)] == [1, 3, 2, 4, 5, 6]


def test_allocation_beyond_the_pool_is_refused_without_side_effects() -> None:
    manager = KVCacheManager(5, BLOCK_SIZE)  # 4 usable blocks = 16 tokens
    request = Request("big", [1] * 17, SamplingParams())
    assert manager.allocate_slots(request, 17) is None
    assert manager.num_free_blocks == 4
    assert manager.get_block_ids("big") == ([],)
    assert not manager.can_ever_fit(17)
    assert manager.can_ever_fit(16)


WINDOWS = (4, None, 6)  # two sliding groups, one global


def check_group_invariants(manager: KVCacheManager, live: dict[str, Request]) -> None:
    """Every data block is in exactly one place: the free queue or one entry of one table."""
    pool = manager.block_pool
    places: Counter[int] = Counter(pool.free_block_ids())
    assert NULL_BLOCK_ID not in places
    for request_id, request in live.items():
        computed = request.num_computed_tokens
        for window, table in zip(WINDOWS, manager.get_block_ids(request_id), strict=True):
            assert len(table) == -(-computed // BLOCK_SIZE)  # positional indexing
            # Exactly the blocks wholly before the next token's window are given back.
            num_gone = 0 if window is None else max(computed - window + 1, 0) // BLOCK_SIZE
            assert table[:num_gone] == [NULL_BLOCK_ID] * num_gone
            assert NULL_BLOCK_ID not in table[num_gone:]
            places.update(table[num_gone:])
    assert sorted(places) == list(range(1, pool.num_blocks))
    assert all(count == 1 for count in places.values())
    free = set(pool.free_block_ids())
    for block in pool.blocks[1:]:
        assert block.ref_cnt == (0 if block.block_id in free else 1)
    held = sum(manager.num_held_blocks(request_id) for request_id in live)
    assert held + manager.num_free_blocks == manager.num_usable_blocks


@settings(max_examples=200, deadline=None)
@given(operations)
def test_grouped_blocks_are_in_exactly_one_place_and_all_return(ops: list) -> None:
    manager = KVCacheManager(40, BLOCK_SIZE, sliding_windows=WINDOWS)
    live: dict[str, Request] = {}
    for op, slot, num_tokens in ops:
        request_id = f"r{slot}"
        request = live.get(request_id)
        if op == "allocate" and request is None:
            request = Request(request_id, [1] * num_tokens, SamplingParams())
            if manager.allocate_slots(request, num_tokens) is not None:
                request.num_computed_tokens = num_tokens
                manager.release_unreachable_blocks(request)
                live[request_id] = request
            else:
                assert manager.get_block_ids(request_id) == ([], [], [])
        elif op == "append" and request is not None:
            tables_before = manager.get_block_ids(request_id)
            free_before = manager.num_free_blocks
            if manager.allocate_slots(request, num_tokens) is None:
                assert manager.get_block_ids(request_id) == tables_before
                assert manager.num_free_blocks == free_before
            else:
                request.num_computed_tokens += num_tokens
                manager.release_unreachable_blocks(request)
        elif op in ("free", "abort") and request is not None:
            manager.free(request)
            del live[request_id]
        check_group_invariants(manager, live)
    for request in list(live.values()):
        manager.free(request)
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)

"""KV block bookkeeping stays consistent under any sequence of operations."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.block_pool import NULL_BLOCK_ID, BlockPool
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


def test_free_queue_hands_out_least_recently_freed_blocks_first() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [blocks[2].block_id, blocks[0].block_id]


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

"""Prefix-cache bookkeeping stays sound under any sequence of admissions, steps and frees.

A fake KV store records, for every slot written, which context the K/V there
stands for (the salt and all tokens up to that position). A cache hit must
then hand out slots whose recorded context is exactly the request's; a write
must only ever go to a block its writer alone holds and that is not cached.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.block_pool import NULL_BLOCK_ID
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

NUM_BLOCKS = 16
BLOCK_SIZE = 4
# Requests start with part of one of these, so prefixes are often shared.
BASE_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9])
SALTS = (None, "tenant")

Context = tuple[str | None, tuple[int, ...]]

admit = st.tuples(
    st.just("admit"),
    st.integers(0, 4),  # request slot
    st.integers(0, len(BASE_PROMPTS) - 1),
    st.integers(0, 13),  # how much of the base prompt
    st.lists(st.integers(0, 2), max_size=5),  # own suffix
    st.sampled_from(SALTS),
    st.integers(1, 12),  # first chunk
)
step = st.tuples(st.just("step"), st.integers(0, 4), st.integers(1, 12))
free = st.tuples(st.just("free"), st.integers(0, 4))
operations = st.lists(st.one_of(admit, step, step, free), max_size=60)


class Harness:
    """Drives a KVCacheManager as the scheduler does and checks it after every operation."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.pool = self.manager.block_pool
        self.live: dict[str, Request] = {}
        self.kv_store: dict[tuple[int, int], Context] = {}

    def context(self, request: Request, position: int) -> Context:
        return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))

    def admit(self, request: Request, chunk: int) -> None:
        queue_before = self.pool.free_block_ids()
        hit = self.manager.get_computed_blocks(request)
        assert hit.num_tokens < request.num_tokens  # the last token is always computed
        for index, block in enumerate(hit.blocks):
            for offset in range(BLOCK_SIZE):
                position = index * BLOCK_SIZE + offset
                assert self.kv_store[(block.block_id, offset)] == self.context(request, position)
        num_new = min(chunk, request.num_tokens - hit.num_tokens)
        new_blocks = self.manager.allocate_slots(request, num_new, hit.blocks)
        if new_blocks is None:
            assert self.pool.free_block_ids() == queue_before  # refused without side effects
            return
        # New blocks are the least recently freed ones, never a block someone holds.
        hit_ids = {block.block_id for block in hit.blocks}
        (new_ids,) = new_blocks
        assert new_ids == [b for b in queue_before if b not in hit_ids][: len(new_ids)]
        request.num_computed_tokens = hit.num_tokens
        self.live[request.request_id] = request
        self.compute(request, num_new)

    def step(self, request: Request, chunk: int) -> None:
        if request.num_computed_tokens == request.num_tokens:
            # The fake model samples a token from a tiny alphabet, so outputs get shared too.
            request.append_output_token(request.num_tokens % 3)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        queue_before = self.pool.free_block_ids()
        new_blocks = self.manager.allocate_slots(request, num_new)
        if new_blocks is None:
            assert self.pool.free_block_ids() == queue_before
            return
        (new_ids,) = new_blocks
        assert new_ids == queue_before[: len(new_ids)]
        self.compute(request, num_new)

    def compute(self, request: Request, num_new: int) -> None:
        (table,) = self.manager.get_block_ids(request.request_id)
        start = request.num_computed_tokens
        for position in range(start, start + num_new):
            block = self.pool.blocks[table[position // BLOCK_SIZE]]
            # Shared and cached blocks are read-only.
            assert block.ref_cnt == 1 and block.block_hash is None
            self.kv_store[(block.block_id, position % BLOCK_SIZE)] = self.context(request, position)
        request.num_computed_tokens += num_new
        self.manager.cache_blocks(request)

    def free(self, request: Request) -> None:
        queue_before = self.pool.free_block_ids()
        (table,) = self.manager.get_block_ids(request.request_id)
        self.manager.free(request)
        del self.live[request.request_id]
        # Released blocks, the request's last block first: cached ones join the back
        # of the eviction order; uncached ones are the next handed out, last freed first.
        released = [b for b in reversed(table) if self.pool.blocks[b].ref_cnt == 0]
        cached = [b for b in released if self.pool.blocks[b].block_hash is not None]
        uncached = [b for b in released if self.pool.blocks[b].block_hash is None]
        assert self.pool.free_block_ids() == uncached[::-1] + queue_before + cached

    def check(self) -> None:
        holders: Counter[int] = Counter()
        for request_id, request in self.live.items():
            (table,) = self.manager.get_block_ids(request_id)
            assert len(table) == -(-request.num_computed_tokens // BLOCK_SIZE)
            holders.update(set(table))
            assert len(set(table)) == len(table)
        assert NULL_BLOCK_ID not in holders
        free_ids = set(self.pool.free_block_ids())
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id]
            assert (block.block_id in free_ids) == (block.ref_cnt == 0)
            if block.block_hash is not None:
                assert block.token_ids is not None
                assert self.pool.get_cached_block(block.block_hash, block.token_ids) is block


@settings(max_examples=300, deadline=None)
@given(operations)
def test_sharing_keeps_ref_counts_contents_and_lru_order_sound(ops: list) -> None:
    harness = Harness()
    for op in ops:
        request = harness.live.get(f"r{op[1]}")
        if op[0] == "admit" and request is None:
            _, slot, base, prefix_len, suffix, salt, chunk = op
            tokens = BASE_PROMPTS[base][:prefix_len] + suffix
            if tokens:
                params = SamplingParams(max_tokens=64)
                harness.admit(Request(f"r{slot}", tokens, params, cache_salt=salt), chunk)
        elif op[0] == "step" and request is not None:
            harness.step(request, op[2])
        elif op[0] == "free" and request is not None:
            harness.free(request)
        harness.check()
    for request in list(harness.live.values()):
        harness.free(request)
    harness.check()
    assert harness.manager.num_free_blocks == harness.manager.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in harness.pool.blocks)


def test_hits_happen_in_the_generated_workload() -> None:
    # Guards the property test against passing vacuously: shared prefixes do get hit.
    harness = Harness()
    params = SamplingParams(max_tokens=64)
    first = Request("first", BASE_PROMPTS[0], params)
    harness.admit(first, 13)
    harness.free(first)
    second = Request("second", [*BASE_PROMPTS[0][:9], 2], params)
    harness.admit(second, 13)
    harness.check()
    assert harness.manager.prefix_cache_hits == 8
    salted = Request("salted", BASE_PROMPTS[0], params, cache_salt="tenant")
    harness.admit(salted, 13)
    assert harness.manager.prefix_cache_hits == 8

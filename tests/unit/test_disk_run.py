"""The KV cache manager's side of the disk tier: what it writes, finds and loads.

Plain bookkeeping over a real store with fake payloads: no model, no tensors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvserve.core.disk_store import DiskBlockStore
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
PAYLOAD = bytes(16)


def make_manager(tmp_path: Path, num_blocks: int = 16) -> KVCacheManager:
    store = DiskBlockStore(
        tmp_path, hashlib.sha256(b"test").digest(), 1 << 20, len(PAYLOAD), BLOCK_SIZE
    )
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True, disk_store=store)


def request(request_id: str, num_tokens: int, salt: str | None = None, start: int = 100) -> Request:
    return Request(
        request_id, list(range(start, start + num_tokens)), SamplingParams(), cache_salt=salt
    )


def compute_all(manager: KVCacheManager, req: Request) -> None:
    """Admit ``req``, compute its whole prompt and cache its blocks."""
    assert manager.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    manager.cache_blocks(req)


def write_stored(manager: KVCacheManager) -> list[int]:
    """What the engine does after a step: write the blocks cached in it."""
    stored = manager.take_stored_blocks()
    assert manager.disk_store is not None
    for block in stored:
        manager.disk_store.write(block.block_hash, block.token_ids, PAYLOAD)
    return [block.block_id for block in stored]


def test_blocks_entering_the_cache_are_handed_out_once_to_be_written(tmp_path: Path) -> None:
    manager = make_manager(tmp_path)
    first = request("a", 18)  # 4 full blocks
    compute_all(manager, first)
    assert len(write_stored(manager)) == 4
    assert manager.take_stored_blocks() == []
    manager.free(first)
    # The same prefix again: cached already, nothing new to write.
    again = request("b", 18)
    hit = manager.get_computed_blocks(again)
    assert manager.allocate_slots(again, 2, hit.blocks) is not None
    again.num_computed_tokens = 18
    manager.cache_blocks(again)
    assert manager.take_stored_blocks() == []


def test_blocks_of_generated_tokens_are_not_handed_out(tmp_path: Path) -> None:
    manager = make_manager(tmp_path)
    req = request("a", 10)  # 2 full prompt blocks, and 2 tokens of a third
    assert manager.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    manager.cache_blocks(req)
    prompt_ids = manager.get_block_ids("a")[0][:2]
    for token_id in range(7):  # decode into the third block and fill a fourth
        req.append_output_token(900 + token_id)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        manager.cache_blocks(req)
    assert manager.num_cached_blocks == 4
    assert write_stored(manager) == prompt_ids


def test_a_prompts_hit_blocks_not_on_disk_are_handed_out_once(tmp_path: Path) -> None:
    manager = make_manager(tmp_path)
    first = request("a", 18)
    compute_all(manager, first)
    not_written = manager.take_stored_blocks()
    assert len(not_written) == 4
    manager.forget_offered(not_written)  # as the engine does when its write queue is full
    manager.free(first)

    def hit_and_step(request_id: str) -> list[int]:
        """Admit a request of the same prompt on its pool hit; compute its last token."""
        req = request(request_id, 18)
        hit = manager.get_computed_blocks(req)
        assert hit.num_tokens == 16
        assert manager.allocate_slots(req, 2, hit.blocks) is not None
        req.num_computed_tokens = 18
        manager.cache_blocks(req)
        return [block.block_id for block in hit.blocks]

    hit_ids = hit_and_step("b")
    queued = manager.take_stored_blocks()
    assert [block.block_id for block in queued] == hit_ids
    hit_and_step("c")  # while b's copies wait to be written: none handed out again
    assert manager.take_stored_blocks() == []
    assert manager.disk_store is not None
    for block in queued:
        manager.disk_store.write(block.block_hash, block.token_ids, PAYLOAD)
    hit_and_step("d")  # on disk now
    assert manager.take_stored_blocks() == []


def test_the_disk_run_starts_past_the_pool_hit_and_loads_as_cached_blocks(
    tmp_path: Path,
) -> None:
    manager = make_manager(tmp_path)
    first = request("a", 18)
    compute_all(manager, first)
    write_stored(manager)
    manager.free(first)
    assert manager.reset_prefix_cache()  # the pool forgets; the disk keeps 4 blocks
    later = request("b", 18)
    run = manager.find_disk_run(later)
    assert run.hashes == manager.block_hashes(later)[:4]
    assert run.parent_hashes[0] is None and run.parent_hashes[1] == run.hashes[0]
    loaded = manager.add_loaded_blocks(later, run)
    assert len(loaded.filled) == len(loaded.chain) == 4
    assert manager.num_free_blocks == 15 - 4  # held while being filled
    manager.release_loaded_blocks(loaded)
    assert manager.num_free_blocks == 15
    # The front of the free queue is not the prefix: it is evicted last, first block last.
    free = manager.block_pool.free_block_ids()
    assert free[-4:] == [block.block_id for block in reversed(loaded.chain)]
    hit = manager.get_computed_blocks(later)
    assert hit.num_tokens == 16 and hit.blocks == loaded.chain


def test_loading_past_a_pool_hit_never_evicts_that_hit(tmp_path: Path) -> None:
    # 6 usable blocks: the pool holds the first 2 blocks of the prefix first in the cached
    # blocks' eviction order, and the disk run needs 3 more.
    first = request("a", 21)  # 5 full blocks, 6 held
    manager = make_manager(tmp_path, num_blocks=7)
    compute_all(manager, first)
    write_stored(manager)
    manager.free(first)
    assert manager.reset_prefix_cache()
    short = request("s", 9)  # shares the first 2 blocks of the prefix
    compute_all(manager, short)
    manager.free(short)
    other = request("x", 13, start=500)  # freed after: the prefix's blocks come first
    compute_all(manager, other)
    manager.free(other)
    write_stored(manager)
    hit_ids = [block.block_id for block in manager.get_computed_blocks(request("p", 21)).blocks]
    pool = manager.block_pool
    eviction_order = [b for b in pool.free_block_ids() if pool.blocks[b].block_hash is not None]
    assert eviction_order[:2] == list(reversed(hit_ids))
    later = request("b", 21)
    run = manager.find_disk_run(later)
    assert len(run.hashes) == 3  # blocks 2..4; blocks 0 and 1 are in the pool
    loaded = manager.add_loaded_blocks(later, run)
    manager.release_loaded_blocks(loaded)
    assert len(loaded.filled) == 3 and len(loaded.chain) == 5
    assert manager.get_computed_blocks(later).num_tokens == 20


def test_salted_requests_find_only_their_salts_blocks(tmp_path: Path) -> None:
    manager = make_manager(tmp_path)
    first = request("a", 18, salt="tenant-a")
    compute_all(manager, first)
    write_stored(manager)
    manager.free(first)
    assert manager.reset_prefix_cache()
    assert manager.find_disk_run(request("b", 18, salt="tenant-b")).hashes == []
    assert manager.find_disk_run(request("c", 18)).hashes == []
    assert len(manager.find_disk_run(request("d", 18, salt="tenant-a")).hashes) == 4

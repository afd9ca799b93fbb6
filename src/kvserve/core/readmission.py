"""When a preempted request may run again: only once it can run to its end.

A new request is admitted optimistically: it takes blocks for its next chunk,
and if the pool runs out later, the newest running request is preempted
(its K/V dropped, its tokens kept) and recomputed later. Readmitting the
preempted request the same way thrashes: it comes back as the newest
running request, so the next older request that needs a block preempts it
again, usually before its recompute is done. A pool smaller than the load
then spends its steps recomputing the same tokens (the soak on SmolLM2 with
64 blocks of 16, where one n = 4 request of 256 tokens does not fit, made
about 7 output tokens a second).

So a preempted request is readmitted only when the free blocks cover, to
the end, both its own worst case and the worst-case growth of every running
request that would be preempted after it (``fits_to_the_end``). After that
it is never preempted again:

- Let P be readmitted, and S the running requests that would be preempted
  after it (smaller preemption key: older, or more important). Write
  ``grow(r)`` for the most blocks r may still take
  (``KVCacheManager.num_blocks_to_grow``). At readmission, the blocks in
  use by S and P plus the sum of their ``grow`` is at most the pool.
- That sum never increases: an allocation adds one block in use and takes
  one from ``grow``; a block given back (a sliding window's) does the
  reverse, or less; a request that ends drops out.
- So whenever a request of S or P needs a block and none is free, some
  block is held only by a request with a larger key than P's (under
  ``fcfs``: newer). The victim is the running request with the largest key:
  such a one, never P or anyone in S.

Hence under ``fcfs`` every request is preempted at most once (under
``priority`` a more important request admitted later may still take its
place), it computes each of its tokens at most twice, and the
oldest request (under ``fcfs``) runs every step until it ends: any pool that
holds one request's worst case (what the engine checks before queueing a
request) finishes every request.

A preempted request that does not fit yet stays at the head of the waiting
queue and nothing behind it is admitted, so newer requests cannot keep
taking the blocks it waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvserve.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from kvserve.core.request import Request


def fits_to_the_end(
    request: Request,
    hit: ComputedBlocks,
    running: Iterable[Request],
    kv_cache_manager: KVCacheManager,
    preemption_key: Callable[[Request], tuple[int, int]],
    max_model_len: int,
    max_chunk_tokens: int,
) -> bool:
    """Whether the free blocks cover the worst case of ``request`` (waiting, holding no
    block, ``hit`` its prefix-cache hit) and the rest of every running request whose
    ``preemption_key`` is smaller than its own."""
    kv = kv_cache_manager

    def worst_growth(r: Request) -> int:
        return kv.num_blocks_to_grow(r, min(r.max_num_tokens, max_model_len), max_chunk_tokens)

    key = preemption_key(request)
    # Hit blocks another request holds are in use already: taking them costs no free block.
    num_shared = sum(1 for block in hit.blocks if block.ref_cnt > 0)
    needed = worst_growth(request) - num_shared
    needed += sum(worst_growth(r) for r in running if preemption_key(r) < key)
    return needed <= kv.num_free_blocks

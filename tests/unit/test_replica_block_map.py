"""The KV-aware router's per-replica block sets, fed with hand-built event batches.

The expected sets are written out by hand from each batch; the hashes are the
engine's own chained hashes of hand-picked tokens.
"""

from __future__ import annotations

import pytest

from kvserve.core.block_hash import BlockHash, extend_block_hashes
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvserve.serve.ray.replica_block_map import ReplicaBlockMap

BLOCK = 4


def _hashes(tokens: list[int]) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, BLOCK, None)
    return hashes


PROMPT = list(range(100, 100 + 4 * BLOCK))  # four full blocks
H = _hashes(PROMPT)


def _stored(hashes: list[BlockHash], first: int = 0) -> BlockStored:
    tokens = PROMPT[first * BLOCK : (first + len(hashes)) * BLOCK]
    parent = H[first - 1] if first else None
    return BlockStored(tuple(hashes), parent, tuple(tokens), BLOCK, medium="CPU")


def _batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(0.0, events)


def test_stored_removed_and_cleared_events_edit_the_replicas_set() -> None:
    blocks = ReplicaBlockMap()
    blocks.add_replica("a")
    blocks.apply("a", 0, _batch(_stored(H[:2]), _stored(H[2:], first=2)))
    assert blocks.longest_prefix(H) == (4, ["a"])
    blocks.apply("a", 1, _batch(BlockRemoved((H[2],))))
    # The chain breaks at the evicted block: only its parents are a usable prefix.
    assert blocks.longest_prefix(H) == (2, ["a"])
    blocks.apply("a", 2, _batch(AllBlocksCleared()))
    assert blocks.longest_prefix(H) == (0, [])
    blocks.apply("a", 3, _batch(_stored(H[:1])))
    assert blocks.longest_prefix(H) == (1, ["a"])


def test_the_longest_prefix_wins_and_equal_prefixes_tie() -> None:
    blocks = ReplicaBlockMap()
    for replica in ("a", "b", "c"):
        blocks.add_replica(replica)
    blocks.apply("a", 0, _batch(_stored(H[:1])))
    blocks.apply("b", 0, _batch(_stored(H[:3])))
    assert blocks.longest_prefix(H) == (3, ["b"])
    blocks.apply("c", 0, _batch(_stored(H[:3])))
    assert blocks.longest_prefix(H) == (3, ["b", "c"])
    # A prompt whose first block nobody holds matches nothing, whatever follows.
    assert blocks.longest_prefix(_hashes([7] * 2 * BLOCK)) == (0, [])
    assert blocks.longest_prefix([]) == (0, [])


def test_a_sequence_gap_empties_the_set_which_refills_from_the_next_batch() -> None:
    blocks = ReplicaBlockMap()
    blocks.add_replica("a")
    blocks.apply("a", 5, _batch(_stored(H[:2])))  # joined late: any first number is fine
    assert blocks.num_gaps == 0 and blocks.longest_prefix(H) == (2, ["a"])
    # Batch 6 was lost (it might have evicted H[0]): nothing is trusted from before it.
    blocks.apply("a", 7, _batch(_stored(H[2:3], first=2)))
    assert blocks.num_gaps == 1
    assert blocks.longest_prefix(H) == (0, [])
    blocks.apply("a", 8, _batch(_stored(H[:2])))
    assert blocks.longest_prefix(H) == (3, ["a"])


def test_a_dropped_replica_is_forgotten_and_its_late_batches_ignored() -> None:
    blocks = ReplicaBlockMap()
    blocks.add_replica("a")
    blocks.apply("a", 0, _batch(_stored(H)))
    blocks.drop_replica("a")
    blocks.apply("a", 1, _batch(_stored(H)))
    assert blocks.longest_prefix(H) == (0, [])
    blocks.add_replica("a")
    blocks.apply("a", 0, _batch(_stored(H[:1])))
    blocks.reset("a")  # an unreadable message: start over
    assert blocks.longest_prefix(H) == (0, [])


@pytest.mark.parametrize(
    "payload", [b"\x01", b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x91\xa3Bad"]
)
def test_a_payload_that_is_not_a_batch_is_refused(payload: bytes) -> None:
    msgspec = pytest.importorskip("msgspec", reason="the kv-events extra is not installed")
    from kvserve.engine.kv_event_publisher import decode_batch

    with pytest.raises(ValueError, match="KV event"):
        decode_batch(payload, msgspec)


def test_decoding_gives_back_the_batch_that_was_encoded() -> None:
    msgspec = pytest.importorskip("msgspec", reason="the kv-events extra is not installed")
    from kvserve.engine.kv_event_publisher import decode_batch, encode_batch

    batch = KVEventBatch(
        12.5,
        (_stored(H[:2]), _stored(H[2:], first=2), BlockRemoved((H[0],), "CPU"), AllBlocksCleared()),
    )
    assert decode_batch(encode_batch(batch, msgspec), msgspec) == batch

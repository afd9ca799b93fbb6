"""Content hashes of full KV blocks: the keys of the prefix cache.

Block ``i`` of a sequence is hashed over the hash of block ``i - 1``, its own
``block_size`` token ids and the request's cache salt. Because the parent's
hash is inside, equal hashes mean equal *prefixes*, not just equal blocks:
the K/V of a block depends on every token before it.

SHA-256 over a fixed byte encoding, not Python's ``hash()``: that one is 64
bits, salted per process for strings, and a collision here would silently
hand a request the K/V of someone else's context. The encoding is
unambiguous: a 32-byte parent, a length-prefixed run of little-endian int64
token ids, then a tagged, length-prefixed salt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Stands in for the parent of a sequence's first block; the version tag keeps
# hashes from an incompatible encoding from ever matching.
_ROOT_PARENT = hashlib.sha256(b"kvserve prefix cache v1").digest()


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None
) -> BlockHash:
    """The hash of one full block, chained from its parent's (None for the first block)."""
    hasher = hashlib.sha256(_ROOT_PARENT if parent_hash is None else parent_hash)
    hasher.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if cache_salt is None:
        hasher.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        hasher.update(b"\x01" + struct.pack("<Q", len(salt)) + salt)
    return hasher.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
) -> None:
    """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` it lacks.

    ``block_hashes`` must hold the hashes of the first blocks of this very
    sequence: tokens only ever get appended, so earlier hashes stay valid.
    """
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        start = index * block_size
        block_hashes.append(
            hash_block_tokens(parent, token_ids[start : start + block_size], cache_salt)
        )

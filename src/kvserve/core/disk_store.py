"""The prefix cache's disk tier: one file per KV block, named by the block's hash.

A block's hash (``block_hash.py``) already names its whole prefix and its
cache salt, so it is a content address that stays valid across restarts:
the store keeps one file per hash, ``<folder>/<identity>/<hash hex>``. The
identity folder is a digest of everything that decides what a block's bytes
mean (the model's weights, the KV dtype and layout, the block size; see
``engine/disk_tier.py``), so a block written by one model or setting is never
read by another.

Files come from disk and are checked before they are trusted:

- written whole: under a temporary name in the same folder, then renamed;
- a header names the format version, the identity, the block hash and the
  block's token ids, and a CRC-32 of everything before it ends the file; a
  file whose size, header, tokens or checksum do not match is deleted and
  counts as a miss (the checksum catches a damaged or torn file; a file
  planted on purpose is kept out by the folder's permissions below, not by
  the checksum, so a cryptographic digest would buy nothing and cost four
  times the CPU: every block written and read is checksummed whole, on the
  engine's cores);
- folders are private (``0700``, owned by the user, not writable by others),
  and a file is read only when it passes the same owner and mode checks
  (:mod:`kvserve.private_cache`).

The store is bounded in bytes: an index of the files (rebuilt from the
folder on start, oldest modification first) is kept in least recently used
order, a read refreshes a file's modification time so the order survives a
restart, and writing past the bound deletes the oldest files first.

An I/O error other than a missing or bad file (a full disk, a folder made
read-only) turns the store off for the rest of the run, with one warning:
requests then simply recompute. Thread-safe: the engine writes from a
background thread and reads from another while the step thread looks up.

Plain Python: payloads are bytes; ``worker/`` turns pool blocks into bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvserve.core.block_hash import BlockHash
from kvserve.private_cache import UntrustedCacheError, untrusted_reason

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
_MAGIC = b"KVSBLK\x00\x01"
# magic, version, identity digest, block hash, number of token ids, payload bytes.
_HEADER = struct.Struct("<8sI32s32sIQ")
# The CRC-32 that ends a file (little-endian).
_CHECKSUM = struct.Struct("<I")
_DIGEST_BYTES = _CHECKSUM.size
_HASH_HEX_LEN = 64


@dataclass
class DiskTierCounters:
    """What the disk tier did so far (cumulative; blocks unless the name says bytes).

    hits: blocks found on disk when requests arrived (past the pool's hits),
        whether or not the run was long enough to be read.
    loads: blocks read back into the pool.
    writes: blocks written; write_drops: blocks not written because the
        write queue was full.
    evictions: files deleted to stay within the bound.
    refused: files found damaged, truncated, foreign or untrusted, and deleted.
    bytes_written, bytes_read: file bytes moved.
    """

    hits: int = 0
    loads: int = 0
    writes: int = 0
    write_drops: int = 0
    evictions: int = 0
    refused: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class DiskTierSnapshot(NamedTuple):
    """The counters at one moment, and the store's state (for reports)."""

    counters: DiskTierCounters
    num_blocks: int
    num_bytes: int
    enabled: bool


class DiskBlockStore:
    """Files of KV blocks under ``root/<identity hex>``, bounded by ``max_bytes``.

    identity: a 32-byte digest of what the blocks' bytes mean.
    payload_bytes: the size of one block's K/V bytes; block_size: its token count.
    """

    def __init__(
        self,
        root: Path,
        identity: bytes,
        max_bytes: int,
        payload_bytes: int,
        block_size: int,
    ) -> None:
        if len(identity) != 32:
            raise ValueError(f"identity must be a 32-byte digest, got {len(identity)} bytes")
        self.identity = identity
        self.max_bytes = max_bytes
        self.payload_bytes = payload_bytes
        self.block_size = block_size
        self.file_bytes = _HEADER.size + 8 * block_size + payload_bytes + _DIGEST_BYTES
        self.folder = root / identity.hex()[:32]
        self.counters = DiskTierCounters()
        self.enabled = True
        self._lock = threading.Lock()
        # Hash -> file bytes, least recently used first.
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._num_bytes = 0
        _make_private_folder(root)
        _make_private_folder(self.folder)
        self._rebuild_index()

    # ------------------------------------------------------------- lookups

    def __contains__(self, block_hash: BlockHash) -> bool:
        return self.enabled and block_hash in self._index

    def snapshot(self) -> DiskTierSnapshot:
        with self._lock:
            counters = DiskTierCounters(**vars(self.counters))
            return DiskTierSnapshot(counters, len(self._index), self._num_bytes, self.enabled)

    def count_hits(self, num_blocks: int) -> None:
        with self._lock:
            self.counters.hits += num_blocks

    # --------------------------------------------------------------- write

    def write(
        self, block_hash: BlockHash, token_ids: Sequence[int], payload: bytes | memoryview
    ) -> bool:
        """Store one block (unless it is there already); False when the store is off
        or the write failed (which turns the store off)."""
        if len(payload) != self.payload_bytes or len(token_ids) != self.block_size:
            raise ValueError(
                f"a block is {self.block_size} tokens and {self.payload_bytes} bytes, "
                f"got {len(token_ids)} tokens and {len(payload)} bytes"
            )
        if not self.enabled or block_hash in self._index:
            return False
        head = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, self.identity, block_hash, len(token_ids), len(payload)
        ) + struct.pack(f"<{len(token_ids)}q", *token_ids)
        # The file is head, payload, checksum of both: hashed and written in pieces, so
        # the payload (most of the bytes) is never copied on the way to the kernel.
        checksum = _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(head)))
        pieces = [memoryview(head), memoryview(payload), memoryview(checksum)]
        size = sum(len(piece) for piece in pieces)
        path = self.folder / block_hash.hex()
        tmp_path = self.folder / f".{block_hash.hex()}.tmp{threading.get_ident()}"
        try:
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, pieces)
            finally:
                os.close(fd)
            os.replace(tmp_path, path)
        except OSError as exc:
            _unlink_quietly(tmp_path)
            self._disable(f"writing {path} failed: {exc}")
            return False
        with self._lock:
            self._index[block_hash] = size
            self._num_bytes += size
            self.counters.writes += 1
            self.counters.bytes_written += size
            self._evict_past_bound()
        return True

    def _evict_past_bound(self) -> None:
        """Delete the least recently used files until the store fits its bound (lock held)."""
        while self._num_bytes > self.max_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self._num_bytes -= size
            self.counters.evictions += 1
            _unlink_quietly(self.folder / block_hash.hex())

    # ---------------------------------------------------------------- read

    def read(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bytes | None:
        """The K/V bytes of the block with this hash and these tokens, or None.

        A file that fails a check is deleted; a missing one is forgotten.
        """
        if not self.enabled or block_hash not in self._index:
            return None
        path = self.folder / block_hash.hex()
        try:
            data = self._read_checked_size(path)
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except _BadFile as exc:
            self._refuse(block_hash, path, str(exc))
            return None
        except OSError as exc:
            self._disable(f"reading {path} failed: {exc}")
            return None
        reason = self._check(data, block_hash, token_ids)
        if reason is not None:
            self._refuse(block_hash, path, reason)
            return None
        # Least recently used order, kept across restarts; a failure only costs that order.
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self.counters.bytes_read += len(data)
        start = _HEADER.size + 8 * self.block_size
        return data[start : start + self.payload_bytes]

    def count_loads(self, num_blocks: int) -> None:
        with self._lock:
            self.counters.loads += num_blocks

    def count_write_drops(self, num_blocks: int) -> None:
        with self._lock:
            self.counters.write_drops += num_blocks

    def _read_checked_size(self, path: Path) -> bytes:
        reason = untrusted_reason(path)
        if reason == "it does not exist":
            raise FileNotFoundError(path)
        if reason is not None:
            raise _BadFile(reason)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                raise _BadFile(f"it is {size} bytes, not {self.file_bytes}")
            chunks = []
            remaining = size
            while remaining:
                chunk = os.read(fd, remaining)
                if not chunk:
                    raise _BadFile("it was truncated while read")
                chunks.append(chunk)
                remaining -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _check(self, data: bytes, block_hash: BlockHash, token_ids: Sequence[int]) -> str | None:
        """Why ``data`` is not the file of this block, or None when it is."""
        body = memoryview(data)[:-_DIGEST_BYTES]
        (checksum,) = _CHECKSUM.unpack_from(data, len(data) - _DIGEST_BYTES)
        if zlib.crc32(body) != checksum:
            return "its checksum does not match its contents"
        magic, version, identity, stored_hash, num_tokens, num_payload = _HEADER.unpack_from(body)
        if magic != _MAGIC or version != FORMAT_VERSION:
            return "it is not a block file of this format"
        if identity != self.identity:
            return "it belongs to another model or KV setting"
        if stored_hash != block_hash:
            return "it holds another block than its name says"
        if num_tokens != self.block_size or num_payload != self.payload_bytes:
            return "its block shape differs"
        stored_tokens = struct.unpack_from(f"<{num_tokens}q", body, _HEADER.size)
        if stored_tokens != tuple(token_ids):
            return "its tokens differ (a hash collision)"
        return None

    # ------------------------------------------------------------ failures

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._num_bytes -= size

    def _refuse(self, block_hash: BlockHash, path: Path, reason: str) -> None:
        logger.warning("deleting the prefix-cache block file %s: %s", path, reason)
        self._forget(block_hash)
        with self._lock:
            self.counters.refused += 1
        _unlink_quietly(path)

    def _disable(self, reason: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        logger.warning(
            "the prefix cache's disk tier is off for the rest of this run (%s); "
            "requests recompute what it would have read",
            reason,
        )

    def clear(self) -> None:
        """Delete every indexed block file (a cold start for benchmarks); counters stay."""
        with self._lock:
            hashes = list(self._index)
            self._index.clear()
            self._num_bytes = 0
        for block_hash in hashes:
            _unlink_quietly(self.folder / block_hash.hex())

    # ---------------------------------------------------------------- start

    def _rebuild_index(self) -> None:
        """Index the folder's block files, oldest first; delete leftovers and misfits."""
        entries = []
        for entry in os.scandir(self.folder):
            name = entry.name
            path = Path(entry.path)
            if name.startswith("."):
                _unlink_quietly(path)  # a write cut short by a crash
                continue
            try:
                block_hash = bytes.fromhex(name)
                info = entry.stat(follow_symlinks=False)
            except (ValueError, OSError):
                continue  # not ours: left alone
            if len(name) != _HASH_HEX_LEN:
                continue
            if not entry.is_file(follow_symlinks=False) or info.st_size != self.file_bytes:
                self.counters.refused += 1
                _unlink_quietly(path)
                continue
            entries.append((info.st_mtime_ns, block_hash, info.st_size))
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self._num_bytes += size
        self._evict_past_bound()


class _BadFile(Exception):
    """A block file that must not be used."""


def _make_private_folder(folder: Path) -> None:
    """Create ``folder`` (``0700``) where missing, then check it as the kernel cache does."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = untrusted_reason(folder, folder=True)
    if reason is not None:
        raise UntrustedCacheError(f"the prefix cache folder {folder} is not used: {reason}")


def _write_all(fd: int, pieces: list[memoryview]) -> None:
    """Write ``pieces`` one after the other to ``fd``, however short each write is."""
    while pieces:
        written = os.writev(fd, pieces)
        while pieces and written >= len(pieces[0]):
            written -= len(pieces[0])
            pieces = pieces[1:]
        if pieces and written:
            pieces = [pieces[0][written:], *pieces[1:]]


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)

"""The prefix cache's disk tier in the step loop: blocks written behind, read back ahead.

Writing: only blocks whose tokens all come from a request's prompt are
written, and blocks filled by generated tokens are not. A later request
shares a prefix of what was sent as a prompt (a system prompt, a document,
the earlier turns of a chat resent); an answer becomes such a prefix only
when the next turn sends it back, and then its blocks are that prompt's
blocks and are written (from the pool, where the new prompt hits them, or as
computed again). Writing every decoded block instead costs a copy, a hash
and a file per block, on the engine's CPU, for blocks that are rarely read:
on a 2-core machine a decode load without reuse ran at 0.92x of the
tier off. ``prefix_cache_disk_write="all"`` writes them too (a chat's last
answer then outlives a restart before the next turn resends it).

After each step, the prompt blocks the step computed or the request hit in
the pool, that the store does not hold and that were not handed out lately
(:meth:`KVCacheManager.take_stored_blocks`), are copied out of the pool (their
K/V are final, and no block is reused before the next schedule) and queued;
a background thread turns the copies into files
(:class:`~kvserve.core.disk_store.DiskBlockStore`). The queue is bounded in
bytes (``WRITE_QUEUE_BYTES``): when the disk cannot keep up, blocks are
dropped (counted), never waited for, and a later prompt holding them may
hand them out again.

Reading: when a request arrives, the KV cache manager looks past its pool
hit into the disk tier (:meth:`KVCacheManager.find_disk_run`). A run of at
least ``prefix_cache_disk_min_blocks`` blocks is read on a background thread
while the request waits here, outside the scheduler, as a constrained
request waits for its grammar; other requests keep stepping. Once read, the
blocks are copied into free pool blocks and entered into the prefix cache
(at the back of the free queue, the last to be evicted), and the request
joins the scheduler, whose ordinary prefix lookup takes them as hits. A
request whose blocks could not be read (a damaged file, a full pool)
computes them as usual.

The store's folder is named by a digest of everything that decides what a
block's bytes mean (:func:`kv_identity`), so another model, dtype, weight
format, attention backend or block size never reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.core.disk_store import DiskBlockStore
from kvserve.core.kv_cache_manager import DiskRun, KVCacheManager, StoredBlock
from kvserve.core.request import Request
from kvserve.errors import InvalidParameterError
from kvserve.loader import ModelSource
from kvserve.loader.source_digest import file_digest, sha256_of_file
from kvserve.private_cache import UntrustedCacheError, untrusted_reason
from kvserve.worker.kv_block_copy import block_bytes, copy_blocks_in, copy_blocks_out

logger = logging.getLogger(__name__)

# Bytes of block copies waiting for the writer thread; a step's blocks that would
# pass it are dropped, so a slow disk costs memory up to this and no more.
WRITE_QUEUE_BYTES = 256 * 1024**2
# Bumped when the meaning of a block's bytes changes in a way the identity misses.
_IDENTITY_VERSION = 1


def model_digest(source: ModelSource) -> str:
    """SHA-256 over the model's files: the GGUF file, or the folder's config and weights."""
    paths = (
        [source.path]
        if source.kind == "gguf"
        else sorted([source.path / "config.json", *source.path.glob("*.safetensors")])
    )
    digest = hashlib.sha256()
    for path in paths:
        try:
            file_hash = file_digest(path.resolve())  # remembered while the file is unchanged
        except OSError:
            file_hash = sha256_of_file(path)
        digest.update(f"{path.name}:{file_hash}\n".encode())
    return digest.hexdigest()


def kv_identity(fields: dict[str, Any]) -> bytes:
    """A 32-byte digest of what a block's bytes mean (``fields`` as JSON)."""
    text = json.dumps({"version": _IDENTITY_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


@dataclass
class _Waiting:
    """A request waiting for its blocks to be read from disk."""

    request: Request
    run: DiskRun
    payloads: futures.Future[list[bytes | None]]


class DiskTier:
    """Write-behind and read-back between the KV pool and a :class:`DiskBlockStore`.

    kv_cache: the runner's pool ``[G, 2, num_blocks, block_size, Hkv, D]``.
    min_blocks: the shortest run worth reading instead of recomputing.
    """

    def __init__(
        self,
        store: DiskBlockStore,
        kv_cache_manager: KVCacheManager,
        kv_cache: torch.Tensor,
        min_blocks: int,
    ) -> None:
        self.store = store
        self.kv_cache_manager = kv_cache_manager
        self.kv_cache = kv_cache
        self.min_blocks = min_blocks
        self._writes: queue.Queue[tuple[list[StoredBlock], torch.Tensor] | None] = queue.Queue()
        self._queued_bytes = 0  # of the copies in _writes; the lock guards it
        self._queued_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-writer")
        self._writer.daemon = True
        self._writer.start()
        self._reader = futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-disk-reader")
        self._waiting: list[_Waiting] = []

    def __len__(self) -> int:
        return len(self._waiting)

    # --------------------------------------------------------------- writes

    def write_behind(self) -> None:
        """Queue the prompt blocks kept in the step that just ran (call before the next
        schedule)."""
        stored = self.kv_cache_manager.take_stored_blocks()
        if not stored or not self.store.enabled:
            return
        num_bytes = len(stored) * self.store.payload_bytes
        with self._queued_lock:
            dropped = self._queued_bytes + num_bytes > WRITE_QUEUE_BYTES
            if not dropped:
                self._queued_bytes += num_bytes
        if dropped:
            self.store.count_write_drops(len(stored))
            self.kv_cache_manager.forget_offered(stored)
            return
        rows = copy_blocks_out(self.kv_cache, [block.block_id for block in stored])
        self._writes.put((stored, rows))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                stored, rows = item
                for index, block in enumerate(stored):
                    if not self.store.enabled:
                        break
                    self.store.write(block.block_hash, block.token_ids, block_bytes(rows, index))
            except Exception:
                logger.exception("writing prefix-cache blocks to disk failed")
            finally:
                if item is not None:
                    with self._queued_lock:
                        self._queued_bytes -= len(item[0]) * self.store.payload_bytes
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._writes.join()

    def clear(self) -> None:
        """Delete every block of this identity from disk (after the queued writes)."""
        self.flush()
        self.store.clear()

    # ---------------------------------------------------------------- reads

    def holds_back(self, request: Request) -> bool:
        """Start reading the request's disk run and keep it here, if the run is long
        enough; False (the caller queues it as usual) otherwise."""
        if not self.store.enabled or request.is_pooling:
            return False
        run = self.kv_cache_manager.find_disk_run(request)
        if run.hashes:
            self.store.count_hits(len(run.hashes))
        if not run.hashes or len(run.hashes) < self.min_blocks:
            return False
        # The sequences of one prompt (n > 1) share one read.
        same = [w.payloads for w in self._waiting if w.run.hashes == run.hashes]
        payloads = same[0] if same else self._reader.submit(self._read_run, run)
        self._waiting.append(_Waiting(request, run, payloads))
        return True

    def _read_run(self, run: DiskRun) -> list[bytes | None]:
        payloads: list[bytes | None] = []
        for block_hash, token_ids in zip(run.hashes, run.token_ids, strict=True):
            payload = self.store.read(block_hash, token_ids)
            payloads.append(payload)
            if payload is None:
                break  # the prefix stops here: later blocks could not be hits
        return payloads

    def admit(self, add_request: Callable[[Request], None]) -> None:
        """Put the blocks of every finished read into the pool; queue their requests."""
        still = []
        for waiting in self._waiting:
            if not waiting.payloads.done():
                still.append(waiting)
                continue
            try:
                payloads = waiting.payloads.result()
            except Exception:
                logger.exception("reading prefix-cache blocks from disk failed")
                payloads = []
            self._load(waiting.request, waiting.run, payloads)
            add_request(waiting.request)
        self._waiting = still

    def _load(self, request: Request, run: DiskRun, payloads: list[bytes | None]) -> None:
        num_read = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        if num_read == 0:
            return
        readable = DiskRun(
            run.hashes[:num_read], run.token_ids[:num_read], run.parent_hashes[:num_read]
        )
        manager = self.kv_cache_manager
        loaded = manager.add_loaded_blocks(request, readable)
        by_hash = {h: p for h, p in zip(readable.hashes, payloads, strict=False) if p is not None}
        filled = loaded.filled
        chosen = [by_hash[block.block_hash] for block in filled if block.block_hash is not None]
        copy_blocks_in(self.kv_cache, [block.block_id for block in filled], chosen)
        manager.release_loaded_blocks(loaded)
        self.store.count_loads(len(filled))

    def drop(self, request_ids: set[str]) -> None:
        """Forget waiting requests (an abort); their reads finish unused."""
        self._waiting = [w for w in self._waiting if w.request.request_id not in request_ids]

    def wait_for_one(self, timeout: float) -> None:
        """Block until one waiting read finished, or ``timeout`` seconds passed."""
        pending = [waiting.payloads for waiting in self._waiting]
        futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Write what is queued, then stop the threads (a second call does nothing)."""
        if not self._writer.is_alive():
            return
        self._writes.put(None)
        self._writer.join()
        self._reader.shutdown(wait=True)


_SALT_SECRET_NAME = "tenant-salt.secret"
_SALT_SECRET_BYTES = 32


def tenant_salt_secret(store: DiskBlockStore) -> bytes | None:
    """A secret kept beside the disk tier's blocks, for salts that survive a restart.

    ``--salt-cache-by-api-key`` derives each key's cache salt from the key and
    a secret; a secret drawn anew at each start would give every key new
    salts, so none of its blocks on disk would ever be found again. The
    secret lives in the tier's private folder (``0600``), which whoever can
    read it can read the blocks of too. None when it cannot be read or made
    (the caller draws one for this run).
    """
    path = store.folder.parent / _SALT_SECRET_NAME
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # made by an earlier run
        else:
            try:
                os.write(fd, secrets.token_bytes(_SALT_SECRET_BYTES))
            finally:
                os.close(fd)
        reason = untrusted_reason(path)
        if reason is None:
            data = path.read_bytes()
            if len(data) == _SALT_SECRET_BYTES:
                return data
            reason = f"it is {len(data)} bytes, not {_SALT_SECRET_BYTES}"
    except OSError as exc:
        reason = str(exc)
    logger.warning(
        "the cache-salt secret %s is not used (%s): salts by API key last this run only",
        path,
        reason,
    )
    return None


def open_disk_store(
    config: EngineConfig,
    source: ModelSource,
    identity_fields: dict[str, Any],
    payload_bytes: int,
) -> DiskBlockStore | None:
    """The store ``prefix_cache_dir`` asks for, or None (no folder, or a model without
    a KV pool). An untrusted folder raises; another I/O error is a warning and no tier."""
    cache = config.cache_config
    if cache.prefix_cache_dir is None or payload_bytes == 0:
        return None
    identity = kv_identity({"model": model_digest(source), **identity_fields})
    try:
        return DiskBlockStore(
            Path(cache.prefix_cache_dir).expanduser(),
            identity,
            cache.disk_bytes,
            payload_bytes,
            cache.block_size,
        )
    except UntrustedCacheError as exc:
        raise InvalidParameterError("prefix_cache_dir", str(exc)) from exc
    except OSError as exc:
        logger.warning("the prefix cache's disk tier is off: %s", exc)
        return None

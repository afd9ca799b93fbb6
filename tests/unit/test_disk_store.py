"""The prefix cache's disk tier store: files named by block hash, checked, bounded, private."""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from kvserve.config import CacheConfig, EngineConfig
from kvserve.core.disk_store import DiskBlockStore
from kvserve.entrypoints.args import add_engine_args, engine_config_from_args
from kvserve.errors import InvalidParameterError
from kvserve.private_cache import UntrustedCacheError

BLOCK_SIZE = 4
PAYLOAD_BYTES = 64
IDENTITY = hashlib.sha256(b"model a").digest()
OTHER_IDENTITY = hashlib.sha256(b"model b").digest()


def block(index: int) -> tuple[bytes, list[int], bytes]:
    """A block's hash, tokens and payload, all different per index."""
    tokens = [index * 10 + offset for offset in range(BLOCK_SIZE)]
    block_hash = hashlib.sha256(repr(tokens).encode()).digest()
    payload = bytes((index * 7 + offset) % 256 for offset in range(PAYLOAD_BYTES))
    return block_hash, tokens, payload


def make_store(root: Path, identity: bytes = IDENTITY, max_bytes: int = 1 << 20) -> DiskBlockStore:
    return DiskBlockStore(root, identity, max_bytes, PAYLOAD_BYTES, BLOCK_SIZE)


def test_a_written_block_reads_back_after_a_restart_in_a_private_folder(tmp_path: Path) -> None:
    root = tmp_path / "prefix"
    store = make_store(root)
    block_hash, tokens, payload = block(1)
    assert store.write(block_hash, tokens, payload)
    path = store.folder / block_hash.hex()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    assert not store.write(block_hash, tokens, payload)  # there already
    restarted = make_store(root)
    assert block_hash in restarted
    assert restarted.read(block_hash, tokens) == payload
    snapshot = restarted.snapshot()
    assert snapshot.num_blocks == 1 and snapshot.num_bytes == store.file_bytes
    assert snapshot.counters.bytes_read == store.file_bytes


def test_short_writes_still_write_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file goes out as head, payload and checksum in one writev; a kernel that takes
    a few bytes at a time (a full pipe, a signal) must still get all of them, in order."""
    whole = make_store(tmp_path / "whole")
    block_hash, tokens, payload = block(3)
    whole.write(block_hash, tokens, memoryview(payload))
    calls: list[int] = []
    writev = os.writev

    def trickle(fd: int, pieces: list[memoryview]) -> int:
        calls.append(len(pieces))
        return writev(fd, [pieces[0][:7]])  # 7 bytes of the first piece at a time

    monkeypatch.setattr(os, "writev", trickle)
    store = make_store(tmp_path / "trickled")
    assert store.write(block_hash, tokens, memoryview(payload))
    assert len(calls) > 10
    written = (store.folder / block_hash.hex()).read_bytes()
    assert written == (whole.folder / block_hash.hex()).read_bytes()
    assert len(written) == store.file_bytes
    assert make_store(tmp_path / "trickled").read(block_hash, tokens) == payload


def test_another_identity_sees_none_of_the_blocks(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    block_hash, tokens, payload = block(1)
    store.write(block_hash, tokens, payload)
    other = make_store(tmp_path, OTHER_IDENTITY)
    assert block_hash not in other
    assert other.read(block_hash, tokens) is None


def test_a_file_planted_from_another_identity_is_refused_and_deleted(tmp_path: Path) -> None:
    other = make_store(tmp_path, OTHER_IDENTITY)
    block_hash, tokens, payload = block(1)
    other.write(block_hash, tokens, payload)
    store = make_store(tmp_path)
    planted = store.folder / block_hash.hex()
    planted.write_bytes((other.folder / block_hash.hex()).read_bytes())
    os.chmod(planted, 0o600)
    store = make_store(tmp_path)  # indexes the planted file
    assert block_hash in store
    assert store.read(block_hash, tokens) is None
    assert not planted.exists() and block_hash not in store
    assert store.snapshot().counters.refused == 1


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "group-writable", "wrong tokens"])
def test_a_damaged_file_is_refused_and_deleted(tmp_path: Path, damage: str) -> None:
    store = make_store(tmp_path)
    block_hash, tokens, payload = block(2)
    store.write(block_hash, tokens, payload)
    path = store.folder / block_hash.hex()
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "group-writable":
        os.chmod(path, 0o620)
    else:
        tokens = [t + 1 for t in tokens]
    assert store.read(block_hash, tokens) is None
    assert not path.exists()
    assert block_hash not in store
    assert store.snapshot().counters.refused == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused_and_deleted(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    block_hash, tokens, payload = block(4)
    store.write(block_hash, tokens, payload)
    path = store.folder / block_hash.hex()
    os.chown(path, 12345, -1)
    assert store.read(block_hash, tokens) is None
    assert not path.exists()


def test_a_truncated_file_found_at_start_is_deleted(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    block_hash, tokens, payload = block(3)
    store.write(block_hash, tokens, payload)
    path = store.folder / block_hash.hex()
    path.write_bytes(path.read_bytes()[:20])
    leftover = store.folder / ".partial.tmp1"
    leftover.write_bytes(b"x")
    restarted = make_store(tmp_path)
    assert block_hash not in restarted
    assert not path.exists() and not leftover.exists()


def test_the_least_recently_used_blocks_go_first_past_the_bound(tmp_path: Path) -> None:
    probe = make_store(tmp_path / "probe")
    store = make_store(tmp_path / "lru", max_bytes=3 * probe.file_bytes)
    blocks = [block(index) for index in range(4)]
    for block_hash, tokens, payload in blocks[:3]:
        store.write(block_hash, tokens, payload)
    # File times can be as coarse as a scheduler tick: keep the steps apart.
    time.sleep(0.03)
    assert store.read(blocks[0][0], blocks[0][1]) == blocks[0][2]  # now the most recent
    time.sleep(0.03)
    store.write(*blocks[3])
    held = [b[0] in store for b in blocks]
    assert held == [True, False, True, True]
    assert store.snapshot().counters.evictions == 1
    assert not (store.folder / blocks[1][0].hex()).exists()
    # The order survives a restart (reads refresh the files' times): block 2 is next.
    restarted = DiskBlockStore(
        tmp_path / "lru", IDENTITY, 2 * probe.file_bytes, PAYLOAD_BYTES, BLOCK_SIZE
    )
    assert [b[0] in restarted for b in blocks] == [True, False, False, True]


def test_a_failed_write_turns_the_tier_off_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(tmp_path)
    written = block(0)
    store.write(*written)

    def disk_full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with caplog.at_level(logging.WARNING):
        assert not store.write(*block(1))
        assert not store.write(*block(2))
    warnings = [r for r in caplog.records if "disk tier is off" in r.getMessage()]
    assert len(warnings) == 1
    assert not store.enabled
    assert written[0] not in store  # off: no lookups either
    assert not [p for p in store.folder.iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UntrustedCacheError, match="group or others"):
        make_store(shared)


def test_disk_tier_arguments_are_checked_and_named() -> None:
    with pytest.raises(InvalidParameterError, match="prefix_cache_dir"):
        CacheConfig(prefix_cache_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(InvalidParameterError, match="prefix_cache_disk_bytes"):
        CacheConfig(prefix_cache_disk_bytes=1 << 20)
    with pytest.raises(InvalidParameterError, match="prefix_cache_disk_bytes"):
        CacheConfig(prefix_cache_dir="/tmp/x", prefix_cache_disk_bytes=0)
    with pytest.raises(InvalidParameterError, match="prefix_cache_disk_min_blocks"):
        CacheConfig(prefix_cache_dir="/tmp/x", prefix_cache_disk_min_blocks=0)
    with pytest.raises(InvalidParameterError, match="prefix_cache_dir"):
        CacheConfig(prefix_cache_dir="  ")
    with pytest.raises(InvalidParameterError, match="prefix_cache_dir"):
        CacheConfig(prefix_cache_dir="/tmp/x").prefix_caching_for(has_sliding_window=True)
    with pytest.raises(InvalidParameterError, match="prefix_cache_dir"):
        EngineConfig.from_kwargs("m", prefix_cache_dir="/tmp/x", tensor_parallel_size=2)
    assert CacheConfig(prefix_cache_dir="/tmp/x").disk_bytes == 4 * 1024**3


def test_disk_tier_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--model", "m", "--prefix-cache-dir", "/tmp/kv", "--prefix-cache-disk-bytes", "2GiB"]
    )
    cache = engine_config_from_args(args).cache_config
    assert cache.prefix_cache_dir == "/tmp/kv"
    assert cache.prefix_cache_disk_bytes == 2 * 1024**3
    assert cache.prefix_cache_disk_min_blocks == 1


def test_salts_by_api_key_survive_a_restart_through_the_tiers_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvserve.engine.disk_tier import tenant_salt_secret
    from kvserve.entrypoints.openai.auth import ApiKeys

    secret = tenant_salt_secret(make_store(tmp_path))
    assert secret is not None and len(secret) == 32
    secret_file = tmp_path / "tenant-salt.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert tenant_salt_secret(make_store(tmp_path, OTHER_IDENTITY)) == secret

    def salts(keys: ApiKeys) -> list[str | None]:
        found = [keys.match(f"Bearer {key}") for key in ("k1", "k2")]
        return [key.cache_salt if key is not None else None for key in found]

    kept = salts(ApiKeys(["k1", "k2"], True, secret))
    assert kept == salts(ApiKeys(["k1", "k2"], True, secret))  # the next start: the same
    assert kept[0] != kept[1] and None not in kept
    assert salts(ApiKeys(["k1", "k2"], True)) != kept  # a secret of this run only
    # A secret file others can write is not used.
    os.chmod(secret_file, 0o622)
    with caplog.at_level(logging.WARNING):
        assert tenant_salt_secret(make_store(tmp_path)) is None
    assert "not used" in caplog.text

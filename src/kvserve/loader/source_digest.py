"""The content hash of a model file, without re-reading the file on every start.

The converted-model cache is keyed by what a model file contains (SHA-256),
so a reinstalled or copied file with the same bytes finds its entry again
and a changed file never finds a stale one. Hashing a multi-gigabyte GGUF on
every start would cost seconds, though, so the digest is remembered in a
small stamp file in the cache, next to the file's identity: device, inode,
size, modification and change times. While all five match, the stamp's
digest is used; when any differs (the file was rewritten, replaced, touched
or copied), the file is hashed again once. The change time cannot be set
from user space, so rewriting a file with the same size and a forged
modification time still shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import NamedTuple

from kvserve.private_cache import atomic_target, is_trusted_file, private_cache_dir

logger = logging.getLogger(__name__)

_STAMP_FOLDER = "stamps"
_READ_CHUNK_BYTES = 1 << 20


class FileIdentity(NamedTuple):
    """What ``stat`` says about a file; any change means its bytes may have changed."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        info = path.stat()
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def sha256_of_file(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(_READ_CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while num_read := file.readinto(buffer):
            digest.update(view[:num_read])
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of ``path``, from its stamp when the file is unchanged since it was hashed.

    ``path`` should be absolute (sources are resolved). The cache folder must
    be usable (UntrustedCacheError otherwise); a stamp that cannot be
    written only costs a re-hash next time.
    """
    identity = FileIdentity.of(path)
    stamp_name = hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json"
    stamp_path = private_cache_dir(_STAMP_FOLDER) / stamp_name
    stored = _read_stamp(stamp_path, path)
    if stored is not None and stored[0] == identity:
        return stored[1]
    digest = sha256_of_file(path)
    stamp = {"path": str(path), "identity": list(identity), "sha256": digest}
    try:
        with atomic_target(stamp_path) as tmp_path:
            tmp_path.write_text(json.dumps(stamp), encoding="utf-8")
    except OSError as exc:
        logger.warning("cannot write the digest stamp %s: %s", stamp_path, exc)
    return digest


def _read_stamp(stamp_path: Path, path: Path) -> tuple[FileIdentity, str] | None:
    """The identity and digest a trusted stamp records for ``path``, or None."""
    if not is_trusted_file(stamp_path):
        return None
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
        if stamp["path"] != str(path):
            return None  # a hash-prefix collision of two paths: hash the file
        return FileIdentity(*(int(v) for v in stamp["identity"])), str(stamp["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

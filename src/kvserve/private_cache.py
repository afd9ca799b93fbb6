"""kvserve's on-disk cache: a private folder, and files in it that are safe to use.

Everything kvserve caches (the compiled C kernels, converted model weights,
tokenizers) lives under ``$KVSERVE_CACHE_DIR`` (default ``~/.cache/kvserve``).
What is read back from there is trusted a great deal: a shared library is
loaded into the process, weights decide every output. So:

- folders are created ``0700``, and an existing folder is used only when it
  is owned by the current user and not writable by group or others;
- a cached file is used only when it is a regular file (not a link) with the
  same owner and the same restriction on writes;
- files are written under a temporary name in the target folder and renamed
  into place, so a reader never sees half a file;
- whoever builds something costly takes a lock file in the folder first
  (:func:`exclusive_lock`), so two processes never build the same thing at
  once: the second waits, then finds the first one's result.

A folder that fails the checks raises :class:`UntrustedCacheError` (an
``OSError``); callers turn that into "no cache" with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"

# Mode bits that let someone other than the owner change a file or a folder's entries.
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedCacheError(OSError):
    """A cache folder exists but belongs to someone else or others can write to it."""


def cache_root() -> Path:
    """``$KVSERVE_CACHE_DIR``, or ``~/.cache/kvserve`` when it is unset or empty."""
    root = os.environ.get(CACHE_DIR_ENV)
    return Path(root) if root else Path.home() / ".cache" / "kvserve"


def untrusted_reason(path: Path, *, folder: bool = False) -> str | None:
    """Why ``path`` must not be used from the cache, or None when it may be.

    folder: expect a folder instead of a regular file. A missing path is
    reported as missing (the caller decides whether that means "build it").
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return f"it cannot be inspected ({exc.strerror or exc})"
    expected = stat.S_ISDIR if folder else stat.S_ISREG
    if not expected(info.st_mode):
        return f"it is not a {'folder' if folder else 'regular file'}"
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by the current user ({os.geteuid()})"
    if info.st_mode & _WRITABLE_BY_OTHERS:
        return f"its mode {stat.filemode(info.st_mode)} lets group or others write to it"
    return None


def is_trusted_file(path: Path) -> bool:
    """True when ``path`` exists and passes the owner and mode checks."""
    return untrusted_reason(path) is None


def private_cache_dir(*parts: str) -> Path:
    """The folder ``cache_root()/parts...``, created ``0700`` where missing, then checked.

    Raises UntrustedCacheError when the cache root or the folder fails the
    checks (e.g. ``KVSERVE_CACHE_DIR`` points at a shared ``/tmp``).
    """
    return private_dir(cache_root(), *parts)


def private_dir(root: Path, *parts: str) -> Path:
    """The folder ``root/parts...``, created ``0700`` where missing, then checked
    (``root`` included), as :func:`private_cache_dir` does under the cache root."""
    folders = [root]
    for part in parts:
        folders.append(folders[-1] / part)
    for folder in folders:
        # parents=True only matters for the root, whose parents (~/.cache) get
        # the default mode; every folder kvserve owns gets 0700.
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = untrusted_reason(folder, folder=True)
        if reason is not None:
            raise UntrustedCacheError(f"cache folder {folder} is not used: {reason}")
    return folders[-1]


@contextlib.contextmanager
def atomic_target(target: Path, suffix: str = "") -> Iterator[Path]:
    """A fresh temporary path next to ``target``, renamed onto it when the block succeeds.

    The temporary file is created ``0600`` (empty) for the block to write;
    when the block raises, it is removed and the exception propagates.
    """
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(handle)
    tmp_path = Path(name)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created ``0600`` where missing) for the block.

    Blocks until no other holder is left, in this process or another. The lock
    file stays: removed, a third process could lock a new file of the same name
    while the second still held the old one. Closing the file releases the lock,
    also when the process dies.
    """
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)

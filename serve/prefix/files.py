"""Files of the prefix store's disk tier: the namespace's directory name and lock, checksums, sizes, and
removal (the manifest first, so a half-removed entry is never taken for a complete one)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np

FORMAT = 2  # 2: the namespace carries the format version
MANIFEST = "manifest.json"
LOCK = ".lock"
MIN_FREE_BYTES = 64 << 20  # a save needs its own size plus this much free on the file system
FULL_RETRY_S = 60.0  # after the disk was found full, how long to wait before writing again
RETRY_S = 30.0  # after an entry could not be read (EIO, a permission), how long before trying again
_LOCKS: dict[Path, list] = {}  # namespace dir -> [open lock file, tiers of this process using it]
_LOCKS_GUARD = threading.Lock()
log = logging.getLogger("jaxhybrid.prefix")


class StoreLocked(ValueError):
    """Another process uses this prefix-store namespace."""


class DiskFull(OSError):
    """Too little free space for a save."""


def namespace(fingerprint: bytes, layout: str = "") -> str:
    """The directory name of one format + model + cache layout inside a store directory."""
    return f"v{FORMAT}-{fingerprint.hex()[:16]}" + (f"-{layout}" if layout else "")


def lock(path: Path) -> None:
    """Take the namespace's lock for this process (shared by this process's tiers)."""
    with _LOCKS_GUARD:
        held = _LOCKS.get(path)
        if held is not None:
            held[1] += 1
            return
        f = open(path / LOCK, "a+")  # noqa: SIM115 - kept open while the lock is held
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise StoreLocked(
                f"the prefix store directory {path} is in use by another process (pid {owner}); "
                "give each server its own --store-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _LOCKS[path] = [f, 1]


def unlock(path: Path) -> None:
    with _LOCKS_GUARD:
        held = _LOCKS.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _LOCKS[path]
            held[0].close()  # closing the file releases the POSIX lock


def is_full(exc: BaseException) -> bool:
    """Whether a save failed for want of space (anywhere in its chain of causes)."""
    while exc is not None:
        if isinstance(exc, DiskFull) or (
            isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def files(path: Path) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = Path(root) / name
            rel = str(full.relative_to(path))
            if rel != MANIFEST:
                out[rel] = full.stat().st_size
    return out


def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        (path / MANIFEST).unlink(missing_ok=True)  # invisible first, then gone
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)

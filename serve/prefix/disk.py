"""Disk tier of the prefix store: checkpoints persisted with Orbax, written in the background.

Layout (one directory per checkpoint; the namespace keeps formats, models and cache layouts apart)::

    store_dir/v<FORMAT>-<fingerprint-hex[:16]>-bs<block_size>-<kv dtype>/
        .lock                                held (POSIX lock) by the one process that uses the namespace
        <checkpoint key, 64 hex>/            a committed Orbax checkpoint (PyTreeCheckpointHandler):
            _CHECKPOINT_METADATA, _METADATA, manifest.ocdbt, ocdbt.process_0/..., d/...
                conv_<i>, state_<i>          the KDA states of KDA layer i at `position`
                kv                           [mla layers, position // block_size, block_size, latent]
                tail                         [mla layers, block_size, latent] (when position % block_size)
            manifest.json                    written last: metadata, every file's size, array checksums
        <key>.orbax-checkpoint-tmp           Orbax's temporary directory of a save in progress (ignored)

Atomicity and visibility: Orbax writes into the temporary directory and renames it when the save is
complete; `manifest.json` is then written (temporary file + rename) as the last step. The indexer accepts
only directories named by a key whose manifest parses, belongs to this model, and lists files that all
exist with their recorded sizes; anything else (a crash mid-save, a truncated copy) is ignored. Arrays are
checked against their recorded CRC32 when restored, so a damaged entry is dropped instead of served.
A save runs on one background thread; the engine never waits for it. Its entry joins the index (becomes
visible to lookups) only when `poll` finds it finished; `flush` waits for every save. Restores run on a
second background thread (`load_async`), so a request waiting for its prefix stalls nobody else.

Long-running servers: opening the tier removes what crashed saves left (temporary and unreadable
directories), so a crash-looping server cannot grow the directory without bound; one process at a time
uses a namespace (a second one gets StoreLocked); when the disk is (nearly) full, writing stops with one
warning and the store keeps serving from memory, trying again after `FULL_RETRY_S`.
"""

from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (see below)
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from jaxhybrid.weights.orbax_io import checkpointer
from serve.prefix.stats import DiskStats

FORMAT = 2  # 2: the namespace carries the format version
MANIFEST = "manifest.json"
LOCK = ".lock"
MIN_FREE_BYTES = 64 << 20  # a save needs its own size plus this much free on the file system
FULL_RETRY_S = 60.0  # after the disk was found full, how long to wait before writing again
_LIVE: weakref.WeakSet[DiskTier] = weakref.WeakSet()
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


def _lock(path: Path) -> None:
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


def _unlock(path: Path) -> None:
    with _LOCKS_GUARD:
        held = _LOCKS.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _LOCKS[path]
            held[0].close()  # closing the file releases the POSIX lock


def _is_full(exc: BaseException) -> bool:
    """Whether a save failed for want of space (anywhere in its chain of causes)."""
    while exc is not None:
        if isinstance(exc, DiskFull) or (
            isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _finish_saves_at_exit() -> None:
    """Let queued saves complete when the interpreter exits without a flush. Runs before the hook of
    concurrent.futures (these hooks run in reverse order), which would stop the executors Orbax uses."""
    for tier in list(_LIVE):
        cf.wait(tier._jobs)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_saves_at_exit)


@dataclasses.dataclass
class DiskEntry:
    """A checkpoint on disk: the states at `position`, the KV of its whole prefix, and where they are."""

    key: bytes
    path: Path
    position: int
    kind: str
    base: bytes  # chain hash of the last full block (the root for position < block_size)
    block_hashes: list[bytes]  # chain hashes of the full blocks 1..position // block_size
    tail: tuple[int, ...]  # tokens after the last full block
    nbytes: int  # array bytes
    disk_bytes: int  # bytes on disk (all files)
    arrays: dict[str, list]  # name -> [shape, dtype, crc32]
    used: float = 0.0  # last use (the manifest's mtime): LRU order across restarts
    holders: int = 0


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _files(path: Path) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = Path(root) / name
            rel = str(full.relative_to(path))
            if rel != MANIFEST:
                out[rel] = full.stat().st_size
    return out


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    if path.is_dir():
        (path / MANIFEST).unlink(missing_ok=True)  # invisible first, then gone
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink(missing_ok=True)


class DiskTier:
    """Index of the committed entries (LRU order), pending saves, and the byte budget of one namespace."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str,
        fingerprint: bytes,
        block_size: int,
        budget: int,
        max_pending: int,
        max_pending_bytes: int,
        stats: DiskStats | None = None,
    ):
        self.dir = Path(root).resolve() / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        _lock(self.dir)  # first: collecting leftovers below must not race another process's saves
        self._closed = False
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.budget = budget
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.stats = stats if stats is not None else DiskStats()
        self.entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # LRU order
        self.block_refs: dict[bytes, int] = {}  # full-block chain hash -> entries holding its KV
        self.pending: dict[bytes, tuple[cf.Future, int]] = {}  # key -> (save, device bytes it holds)
        self._jobs: list[cf.Future] = []
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk")
        self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-read")
        self.full_until = 0.0  # monotonic time before which no save is tried (the disk was full)
        self._warned_full = False
        self._saver: Any = None  # Orbax checkpointers: one used only by the worker, one by the caller
        self._loader: Any = None
        self.ignored: list[str] = []  # names in the directory that were not complete entries (at start)
        self.collected_bytes = 0  # bytes of those leftovers, removed at start
        self.bytes = 0  # on disk, committed entries
        _LIVE.add(self)
        self.index()

    # --- index -----------------------------------------------------------------------------------
    def index(self) -> None:
        """Read the manifests of every committed entry; remove what is not one (temporary and partial
        directories of crashed saves, unreadable entries), except saves this process has in flight."""
        found = []
        busy = self._in_flight_here()
        for child in sorted(self.dir.iterdir()):
            if child.name == LOCK or child.name in busy:
                continue
            entry = self._read(child)
            if entry is None:
                self.ignored.append(child.name)
                self.collected_bytes += _size(child)
                _remove(child)
            else:
                found.append(entry)
        if self.ignored:
            self.stats.collected += len(self.ignored)
            log.info(
                "prefix store %s: removed %d leftovers of interrupted saves (%d bytes)",
                self.dir,
                len(self.ignored),
                self.collected_bytes,
            )
        for entry in sorted(found, key=lambda e: e.used):  # least recently used first
            self._add(entry)
        self.enforce_budget()

    def _in_flight_here(self) -> set[str]:
        """Directory names of saves other tiers of this process have queued in this namespace."""
        names = set()
        for tier in list(_LIVE):
            if tier is not self and tier.dir == self.dir:
                for key in tier.pending:
                    names |= {key.hex(), key.hex() + ".orbax-checkpoint-tmp"}
        return names

    def _read(self, path: Path) -> DiskEntry | None:
        name = path.name
        if len(name) != 64 or not path.is_dir():
            return None  # Orbax temporary directories end in '.orbax-checkpoint-tmp'
        try:
            key = bytes.fromhex(name)
            stat = (path / MANIFEST).stat()
            m = json.loads((path / MANIFEST).read_text())
            if m["format"] != FORMAT or m["fingerprint"] != self.fingerprint.hex() or m["key"] != name:
                return None
            if m["block_size"] != self.block_size:
                return None
            for rel, size in m["files"].items():
                if (path / rel).stat().st_size != size:
                    return None
            entry = DiskEntry(
                key=key,
                path=path,
                position=int(m["position"]),
                kind=str(m["kind"]),
                base=bytes.fromhex(m["base"]),
                block_hashes=[bytes.fromhex(h) for h in m["block_hashes"]],
                tail=tuple(int(t) for t in m["tail"]),
                nbytes=int(m["nbytes"]),
                disk_bytes=sum(m["files"].values()) + stat.st_size,
                arrays={
                    k: [list(shape), str(dtype), int(crc)] for k, (shape, dtype, crc) in m["arrays"].items()
                },
                used=stat.st_mtime,
            )
        except Exception:  # noqa: BLE001 - unreadable or malformed: not a (complete) entry
            return None
        if len(entry.block_hashes) != entry.position // self.block_size or len(entry.tail) != (
            entry.position % self.block_size
        ):
            return None
        return entry

    def _add(self, entry: DiskEntry) -> None:
        self.entries[entry.key] = entry
        self.bytes += entry.disk_bytes
        for h in entry.block_hashes:
            self.block_refs[h] = self.block_refs.get(h, 0) + 1

    def _drop(self, entry: DiskEntry) -> None:
        del self.entries[entry.key]
        self.bytes -= entry.disk_bytes
        for h in entry.block_hashes:
            self.block_refs[h] -= 1
            if not self.block_refs[h]:
                del self.block_refs[h]
        self._jobs.append(self._worker.submit(_remove, entry.path))

    @property
    def pending_bytes(self) -> int:
        return sum(n for _, n in self.pending.values())

    def enforce_budget(self) -> None:
        """Drop least recently used entries (none held by a restore in progress) while over the budget."""
        used = self.bytes
        for entry in list(self.entries.values()):
            if used <= self.budget:
                break
            if entry.holders:
                continue
            used -= entry.disk_bytes
            self._drop(entry)
            self.stats.dropped += 1

    def touch(self, entry: DiskEntry) -> None:
        self.entries.move_to_end(entry.key)
        try:
            os.utime(entry.path / MANIFEST)  # the LRU order survives a restart
        except OSError:
            pass

    # --- saving ----------------------------------------------------------------------------------
    def wants(self, key: bytes, nbytes: int) -> bool:
        """Whether a checkpoint should be written: not on disk or on its way, fits, queue not full, and
        the disk not recently found full."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        if time.monotonic() < self.full_until:
            self.stats.skipped += 1
            return False
        if key in self.pending or nbytes > self.budget:
            return False
        if len(self.pending) >= self.max_pending or self.pending_bytes + nbytes > self.max_pending_bytes:
            self.stats.skipped += 1
            return False
        return True

    def submit(self, meta: dict[str, Any], payload: Any, device_bytes: int) -> None:
        """Queue a save. `payload` = (states, kv, num_full, tail): device arrays, copied to the host by the
        worker (kv: per MLA layer [>= num_full, block_size, latent] or None; tail: per MLA layer or None)."""
        key = bytes.fromhex(meta["key"])
        fut = self._worker.submit(self._save, meta, payload)
        self.pending[key] = (fut, device_bytes)
        self._jobs.append(fut)

    def _save(self, meta: dict[str, Any], payload: Any) -> tuple[DiskEntry, float]:
        import jax
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        states, kv, num_full, tail = jax.device_get(payload)
        arrays: dict[str, np.ndarray] = {}
        for i, (conv, state) in enumerate(states):
            arrays[f"conv_{i}"], arrays[f"state_{i}"] = np.asarray(conv), np.asarray(state)
        if num_full:
            arrays["kv"] = np.stack([np.asarray(k)[:num_full] for k in kv])
        if tail is not None:
            arrays["tail"] = np.stack([np.asarray(t) for t in tail])
        final = self.dir / meta["key"]
        tmp = final.with_name(final.name + ".orbax-checkpoint-tmp")
        _remove(tmp)  # leftovers of an earlier crash, or an entry the index rejected
        _remove(final)
        need = sum(a.nbytes for a in arrays.values()) + MIN_FREE_BYTES
        if shutil.disk_usage(self.dir).free < need:
            raise DiskFull(errno.ENOSPC, f"less than {need} bytes free for a save", str(self.dir))
        if self._saver is None:
            self._saver = checkpointer(None)
        try:
            self._saver.save(final, args=ocp.args.PyTreeSave(arrays))
        except BaseException:
            _remove(tmp)  # a failed save leaves nothing behind
            _remove(final)
            raise
        files = _files(final)
        manifest = dict(
            meta,
            format=FORMAT,
            nbytes=sum(a.nbytes for a in arrays.values()),
            arrays={k: [list(a.shape), a.dtype.name, _crc(a)] for k, a in arrays.items()},
            files=files,
        )
        part = final / (MANIFEST + ".tmp")
        with open(part, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, final / MANIFEST)
        entry = self._read(final)
        if entry is None:
            raise RuntimeError(f"{final}: the checkpoint just written does not read back")
        return entry, time.perf_counter() - t0

    def poll(self, wait: bool = False) -> list[DiskEntry]:
        """Make finished saves visible (all of them, waiting, with `wait`); returns the new entries."""
        if wait:
            cf.wait(self._jobs)
        self._jobs = [j for j in self._jobs if not j.done()]
        new = []
        for key, (fut, _) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[key]
            try:
                entry, dt = fut.result()
            except Exception as exc:  # noqa: BLE001 - a failed save loses one cache entry, nothing else
                self.stats.save_errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                if _is_full(exc):
                    self._disk_full(exc)
                continue
            self._add(entry)
            self.stats.saves += 1
            self.stats.save_time_s += dt
            new.append(entry)
        if new:
            self.enforce_budget()
        if wait:
            cf.wait(self._jobs)  # removals the budget queued
            self._jobs = []
        return new

    def _disk_full(self, exc: BaseException) -> None:
        """Stop writing for FULL_RETRY_S; warn once per run (the cache keeps serving from memory)."""
        self.full_until = time.monotonic() + FULL_RETRY_S
        self.stats.full += 1
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "prefix store %s: the disk is full (%s); not writing checkpoints for %.0f s at a time, "
                "serving from memory",
                self.dir,
                exc,
                FULL_RETRY_S,
            )

    # --- loading ---------------------------------------------------------------------------------
    def load(self, entry: DiskEntry) -> tuple[list, np.ndarray | None, np.ndarray | None] | None:
        """(states [(conv, state) per KDA layer], kv [mla, n, block_size, latent] or None, tail or None),
        checked against the manifest; None (and the entry dropped) when it cannot be read. Blocking: the
        engine uses `load_async` + `finish_load`."""
        return self.finish_load(entry, self.load_async(entry))

    def load_async(self, entry: DiskEntry) -> cf.Future:
        """Start reading `entry` on the reader thread; it cannot be dropped until `finish_load`."""
        entry.holders += 1
        return self._reader.submit(self._read_arrays, entry)

    def finish_load(self, entry: DiskEntry, fut: cf.Future) -> tuple[list, Any, Any] | None:
        """The result of a finished `load_async` (see `load`), on the thread that owns the index."""
        entry.holders -= 1
        try:
            return fut.result()
        except Exception as exc:  # noqa: BLE001 - unreadable or damaged: drop it, recompute instead
            self.stats.restore_errors += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            if entry.key in self.entries and not entry.holders:
                self._drop(entry)
            return None

    def _read_arrays(self, entry: DiskEntry) -> tuple[list, Any, Any]:
        import orbax.checkpoint as ocp

        if self._loader is None:
            self._loader = checkpointer(None)
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in entry.arrays}
        tree = self._loader.restore(entry.path, args=ocp.args.PyTreeRestore(restore_args=args))
        for name, (shape, dtype, crc) in entry.arrays.items():
            a = tree[name]
            if list(a.shape) != shape or a.dtype.name != dtype or _crc(a) != crc:
                raise ValueError(f"array '{name}' does not match its manifest")
        states = [(tree[f"conv_{i}"], tree[f"state_{i}"]) for i in range(_count(tree, "conv_"))]
        if (entry.position // self.block_size) != (tree["kv"].shape[1] if "kv" in tree else 0):
            raise ValueError("the stored KV does not cover the prefix")
        if bool(entry.position % self.block_size) != ("tail" in tree):
            raise ValueError("the partial block's KV is missing or unexpected")
        return states, tree.get("kv"), tree.get("tail")

    def close(self) -> None:
        """Finish pending saves and reads, release the namespace's lock."""
        if self._closed:
            return
        self._closed = True
        self.poll(wait=True)
        self._worker.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        _unlock(self.dir)


def _count(tree: dict[str, Any], prefix: str) -> int:
    return sum(1 for k in tree if k.startswith(prefix))

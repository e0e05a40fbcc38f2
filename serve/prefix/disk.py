"""Disk tier of the prefix store: checkpoints persisted with Orbax, written in the background.

Layout (one directory per checkpoint; the namespace keeps formats, models and cache layouts apart)::

    store_dir/v<FORMAT>-<fingerprint-hex[:16]>-bs<block_size>-<kv dtype>/
        .lock                                held (POSIX lock) by the one server that uses the namespace
        <checkpoint key, 64 hex>/            a committed Orbax checkpoint (PyTreeCheckpointHandler):
            conv_<i>, state_<i>              the KDA states of KDA layer i at `position`
            kv                               [mla layers, position // block_size, block_size, latent]
            tail                             [mla layers, block_size, latent] (when position % block_size)
            manifest.json                    written last: metadata, every file's size, array checksums
        <key>.orbax-checkpoint-tmp           Orbax's temporary directory of a save in progress

Atomicity: Orbax writes into the temporary directory and renames it when complete; `manifest.json` is
written (temporary file + rename) last. Only directories with a valid manifest whose files all exist with
their recorded sizes are entries; arrays are checked against their CRC32 when restored (one process), so
a damaged entry is dropped instead of served. Opening removes what crashed saves left behind. When the disk
is (nearly) full, writing stops with one warning and resumes after FULL_RETRY_S.

Saves still queued complete on `close` (the CLI and the server close or flush the engine on the way
out); a process that exits without it may lose them: they are a cache, and whatever they left half written
is collected at the next open. Only an entry proven corrupt (a bad manifest, a missing or truncated file, a
checksum mismatch) is removed; one that cannot be read for now (EIO, a permission) is skipped, logged and
tried again after RETRY_S.

Time: saves run on one background thread and reads on another. What finished is *observed* (`observe`:
on process 0, or the only process) and then *applied* (`apply`) at a step boundary, so that with several
processes every process changes its index at the same step, from process 0's observations carried in the
step log. Several processes (JAX multi-controller): every process holds its shards of the states; each
save is one Orbax multi-process save of the sharded arrays (every process writes its shards, process 0
commits and writes the manifest) and each read restores every process's shards; process 0 alone takes the
lock, collects leftovers, deletes and touches files.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import shutil
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from jaxhybrid.weights.orbax_io import checkpointer
from serve.prefix import files
from serve.prefix.accounts import DiskFiles
from serve.prefix.checkpoints import KindTally
from serve.prefix.entries import DiskEntry, is_transient, read_arrays, read_entry, write_entry
from serve.prefix.events import EventLog, StateRemoved, StateStored
from serve.prefix.files import (
    FULL_RETRY_S,
    LOCK,
    MANIFEST,
    MIN_FREE_BYTES,
    RETRY_S,
    StoreLocked,
    namespace,
)
from serve.prefix.stats import DiskStats
from serve.prefix.types import Tier
from sharding.multihost import Peers

__all__ = ["DiskEntry", "DiskTier", "StoreLocked", "namespace", "LOCK", "MANIFEST"]
log = logging.getLogger("jaxhybrid.prefix")
_LIVE: weakref.WeakSet[DiskTier] = weakref.WeakSet()  # for saves in flight in another tier of this process


class SaveFailure(NamedTuple):
    """A background save that raised: its entry, the error, and whether the disk was full."""

    key_hex: str
    error: str
    for_space: bool


@dataclasses.dataclass(frozen=True)
class DiskNews:
    """What the disk tier saw finish since it last looked (`DiskTier.observe`), which every process applies
    at the same step (`DiskTier.apply`): saves done or failed, entries that became readable or proved
    corrupt, and the disk's full state where it changed (None: unchanged)."""

    saved: tuple[str, ...] = ()  # entries' keys, hex
    failed: tuple[SaveFailure, ...] = ()
    full: bool | None = None
    found: tuple[str, ...] = ()  # entry names
    corrupt: tuple[str, ...] = ()

    def has_news(self) -> bool:
        """Whether applying this changes anything."""
        return bool(self.saved or self.failed or self.found or self.corrupt) or self.full is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "saved": list(self.saved),
            "failed": [list(f) for f in self.failed],
            "full": self.full,
            "found": list(self.found),
            "corrupt": list(self.corrupt),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DiskNews:
        failed = tuple(SaveFailure(*f) for f in data["failed"])
        return cls(tuple(data["saved"]), failed, data["full"], tuple(data["found"]), tuple(data["corrupt"]))


class DiskTier:
    """Index of the committed entries (LRU order), pending saves, and the byte budget of one namespace.
    Its collaborators: `reads` (DiskReads) reads entries back on a thread of its own and hands an entry
    proven corrupt back to be dropped; `space` (DiskFull) says whether saves are paused for a full disk;
    `skipped` (Unreadable) retries entries that could not be read for now.
    `restore_shardings(name, shape, dtype)`: where a read puts each array with several processes."""

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
        peers: Peers | None = None,
        restore_shardings: Callable[[str, tuple[int, ...], str], Any] | None = None,
        log: EventLog | None = None,
    ):
        """`log`: where StateStored / StateRemoved of tier disk go (`serve.prefix.events`)."""
        self.peers, self.log = peers or Peers(0, 1), log
        self.dir = Path(root).resolve() / namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.peers.leader:
            files.lock(self.dir)  # first: collecting leftovers must not race another server's saves
        self._closed = False
        self.fingerprint, self.block_size = fingerprint, block_size
        self.budget, self.max_pending, self.max_pending_bytes = budget, max_pending, max_pending_bytes
        self.restore_shardings = restore_shardings
        self.stats = stats if stats is not None else DiskStats()
        self.entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # LRU order
        self.block_refs: dict[bytes, int] = {}  # full-block chain hash -> entries holding its KV
        self.pending: dict[bytes, tuple[cf.Future, int]] = {}  # key -> (save, device bytes it holds)
        self._jobs: list[cf.Future] = []
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk")
        self.space = DiskFull(self.dir, self.stats)
        self._saver: Any = None  # the Orbax checkpointer of the worker thread (the reads have their own)
        self.reads = DiskReads(
            self._checkpointer, block_size, self.peers, restore_shardings, self.stats, self.dir, self._corrupt
        )
        self.ignored: list[str] = []  # names in the directory that were not complete entries (at start)
        self.skipped = Unreadable(self.dir, fingerprint, block_size)
        self.collected_bytes = 0  # bytes of those leftovers, removed at start
        self.bytes = 0  # on disk, committed entries
        _LIVE.add(self)
        self.index()

    def _checkpointer(self) -> Any:
        if not self.peers.several:
            return checkpointer(None)
        return checkpointer(None, processes=set(range(self.peers.count)))

    # --- index -----------------------------------------------------------------------------------
    def index(self) -> None:
        """Read the manifests of every committed entry; process 0 removes what is not one (temporary and
        partial directories of crashed saves, unreadable entries), except saves this process has in flight;
        with several processes every process then indexes exactly process 0's entries."""
        found = []
        busy = self._in_flight_here()
        for child in sorted(self.dir.iterdir()):
            if child.name == LOCK or child.name in busy:
                continue
            try:
                entry = read_entry(child, self.fingerprint, self.block_size)
            except OSError as exc:
                self.skipped.skip(child.name, exc)
                continue
            if entry is not None:
                found.append(entry)
            elif self.peers.leader:
                self.ignored.append(child.name)
                self.collected_bytes += files.size(child)
                files.remove(child)
        if self.ignored:
            self.stats.collected += len(self.ignored)
            log.info(
                "prefix store %s: removed %d leftovers of interrupted saves (%d bytes)",
                self.dir,
                len(self.ignored),
                self.collected_bytes,
            )
        found.sort(key=lambda e: e.used)  # least recently used first
        order = self.peers.broadcast([e.key.hex() for e in found])
        by_key = {e.key.hex(): e for e in found}
        for key in order:
            if key not in by_key:
                raise RuntimeError(f"prefix store {self.dir}: entry {key} of process 0 is unreadable here")
            self._add(by_key[key])
        self.enforce_budget()

    def _in_flight_here(self) -> set[str]:
        """Directory names of saves other tiers of this process have queued in this namespace."""
        names = set()
        for tier in list(_LIVE):
            if tier is not self and tier.dir == self.dir:
                for key in tier.pending:
                    names |= {key.hex(), key.hex() + ".orbax-checkpoint-tmp"}
        return names

    def _add(self, entry: DiskEntry) -> None:
        self.entries[entry.key] = entry
        self.bytes += entry.disk_bytes
        for h in entry.block_hashes:
            self.block_refs[h] = self.block_refs.get(h, 0) + 1
        if self.log is not None:
            base = entry.block_hashes[-1] if entry.block_hashes else None
            kind, tail = entry.kind.value, list(entry.tail)
            self.log.add(StateStored(entry.key, entry.position, kind, "disk", base, tail, entry.disk_bytes))

    def _drop(self, entry: DiskEntry) -> None:
        del self.entries[entry.key]
        if self.log is not None:
            self.log.add(StateRemoved(entry.key, "disk"))
        self.bytes -= entry.disk_bytes
        for h in entry.block_hashes:
            self.block_refs[h] -= 1
            if not self.block_refs[h]:
                del self.block_refs[h]
        if self.peers.leader:
            self._jobs.append(self._worker.submit(files.remove, entry.path))

    def _corrupt(self, entry: DiskEntry) -> None:
        """A read proved `entry` corrupt and nothing holds it: out of the index (unless already dropped)."""
        if entry.key in self.entries:
            self._drop(entry)

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
        if self.peers.leader:
            try:
                os.utime(entry.path / MANIFEST)  # the LRU order survives a restart
            except OSError:
                pass

    # --- saving ----------------------------------------------------------------------------------
    def wants(self, key: bytes, nbytes: int) -> bool:
        """Whether a checkpoint should be written: not on disk or on its way, fits, queue not full, and
        the disk not found full."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        if self.space.full:
            self.stats.skipped += 1
            return False
        if key in self.pending or nbytes > self.budget:
            return False
        if len(self.pending) >= self.max_pending or self.pending_bytes + nbytes > self.max_pending_bytes:
            self.stats.skipped += 1
            return False
        return True

    def submit(self, meta: dict[str, Any], arrays: dict[str, Any], device_bytes: int) -> None:
        """Queue a save of `arrays` (name -> device array the caller no longer changes)."""
        key = bytes.fromhex(meta["key"])
        fut = self._worker.submit(self._write, meta, arrays)
        self.pending[key] = (fut, device_bytes)
        self._jobs.append(fut)

    def _write(self, meta: dict[str, Any], arrays: dict[str, Any]) -> tuple[DiskEntry | None, float]:
        if self._saver is None:
            self._saver = self._checkpointer()
        return write_entry(self._saver, self.dir, meta, arrays, self.peers)

    # --- what finished: observed on process 0, applied everywhere at a step boundary -------------------
    def observe(self) -> DiskNews:
        """Saves that finished (ok or failed, and whether for want of space), and the disk's full state
        when it changes (None: unchanged)."""
        saved, failed = [], []
        for key, (fut, _) in self.pending.items():
            if fut.done():
                exc = fut.exception()
                if exc is None:
                    saved.append(key.hex())
                else:
                    failed.append(SaveFailure(key.hex(), f"{type(exc).__name__}: {exc}", files.is_full(exc)))
        full = self.space.still_full()
        if not full and self.peers.several and self.pending:  # only process 0 looks at the disk
            full = shutil.disk_usage(self.dir).free < self.max_pending_bytes + MIN_FREE_BYTES
        found, corrupt = self.skipped.due()
        changed = None if full == self.space.full else full
        return DiskNews(tuple(saved), tuple(failed), changed, tuple(found), tuple(corrupt))

    def apply(self, events: DiskNews) -> list[DiskEntry]:
        """Act on `observe`'s result (from process 0): new entries join the index; returns them."""
        new = []
        for key_hex in events.saved:
            fut, _ = self.pending.pop(bytes.fromhex(key_hex))
            entry, dt = fut.result()  # on another process: its own part of the same save
            if entry is None:
                entry = read_entry(self.dir / key_hex, self.fingerprint, self.block_size)
            if entry is None:
                raise RuntimeError(
                    f"prefix store {self.dir}: entry {key_hex} of process 0 is unreadable here"
                )
            self._add(entry)
            self.stats.saves += 1
            self.stats.save_time_s += dt
            new.append(entry)
        for name in events.found:
            entry = self.skipped.read(name)
            if entry is not None and entry.key not in self.entries:
                self._add(entry)
                new.append(entry)
        for name in events.corrupt:
            self.skipped.forget(name)
            if self.peers.leader:
                log.warning("prefix store %s: removing %s: not a valid entry", self.dir, name)
                self._jobs.append(self._worker.submit(files.remove, self.dir / name))
        full = events.full
        for key_hex, error, for_space in events.failed:
            fut, _ = self.pending.pop(bytes.fromhex(key_hex))
            cf.wait([fut])
            self.stats.save_errors += 1
            self.stats.last_error = error
            log.warning("prefix store %s: saving checkpoint %s failed: %s", self.dir, key_hex[:16], error)
            if for_space:
                full = True
        self.space.set(full)
        if new:
            self.enforce_budget()
        self._jobs = [j for j in self._jobs if not j.done()]
        return new

    def poll(self, wait: bool = False) -> list[DiskEntry]:
        """One process: observe + apply (waiting for every save first with `wait`)."""
        if wait:
            cf.wait(self._jobs)
        new = self.apply(self.observe())
        if wait:
            cf.wait(self._jobs)  # removals the budget queued
            self._jobs = []
        return new

    def ledger(self, by_kind: KindTally) -> DiskFiles:
        """This tier's own part of the store's ledger (saves on their way, files it ignores); adds each
        committed entry's bytes (states + KV of their prefixes + files) to `by_kind`."""
        for entry in self.entries.values():
            by_kind.add(entry.kind, Tier.DISK, entry.disk_bytes)
        return DiskFiles(len(self.pending), self.pending_bytes, len(self.ignored), str(self.dir))

    def close(self) -> None:
        """Finish pending saves and reads, release the namespace's lock."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.peers.several:
                self.poll(wait=True)
        finally:
            cf.wait(self._jobs)
            self._worker.shutdown(wait=True)
            self.reads.close()
            if self.peers.leader:
                files.unlock(self.dir)


class DiskReads:
    """Entries read back: on a thread of its own, with an Orbax checkpointer used only there, and the outcome
    taken on the owning thread (counted in `stats`; an entry proven corrupt handed to `corrupt`, one that may
    read later kept). An entry being read is held (`DiskEntry.holders`): the budget does not drop it."""

    def __init__(
        self,
        make_checkpointer: Callable[[], Any],
        block_size: int,
        peers: Peers,
        shardings: Any,
        stats: DiskStats,
        directory: Path,
        corrupt: Callable[[DiskEntry], None],
    ):
        self.make_checkpointer, self.block_size = make_checkpointer, block_size
        self.peers, self.shardings = peers, shardings
        self.stats, self.dir, self.corrupt = stats, directory, corrupt
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="prefix-disk-read")
        self._loader: Any = None

    def start(self, entry: DiskEntry) -> cf.Future:
        """Start reading `entry` on the reader thread; it cannot be dropped until `finish`."""
        entry.holders += 1
        return self._pool.submit(self._read, entry)

    def finish(
        self, entry: DiskEntry, fut: cf.Future, leader_ok: bool | None = None, leader_transient: bool = False
    ) -> Any:
        """`start`'s result or None (an entry proven corrupt is dropped, one that may read later kept); on
        the owning thread. `leader_ok` / `leader_transient`: process 0's outcome, which all follow."""
        entry.holders -= 1
        exc = fut.exception()
        if leader_ok is None:
            leader_ok = exc is None
            leader_transient = exc is not None and is_transient(exc)
        if leader_ok and exc is not None:
            raise RuntimeError(f"process {self.peers.index} could not read {entry.path}: {exc}") from exc
        if leader_ok:
            return fut.result()
        self.stats.restore_errors += 1
        self.stats.last_error = (
            f"{type(exc).__name__}: {exc}" if exc is not None else "unreadable on process 0"
        )
        if leader_transient:
            log.warning("prefix store %s: reading %s failed (%s); kept", self.dir, entry.key.hex(), exc)
        elif not entry.holders:
            self.corrupt(entry)
        return None

    def _read(self, entry: DiskEntry) -> tuple[list, Any, Any]:
        if self._loader is None:
            self._loader = self.make_checkpointer()
        return read_arrays(self._loader, entry, self.block_size, self.peers, self.shardings)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class DiskFull:
    """Whether the disk was found full: then no save is tried for FULL_RETRY_S at a time, with one warning per
    run (the cache keeps serving from memory)."""

    def __init__(self, directory: Path, stats: DiskStats):
        self.dir, self.stats = directory, stats
        self.full, self.until, self._warned = False, 0.0, False

    def still_full(self) -> bool:
        """Full, and not yet due to try again."""
        return self.full and time.monotonic() < self.until

    def set(self, full: bool | None) -> None:
        """Act on process 0's finding: True full (from now), False writable again, None unchanged."""
        if full and not self.full:
            self.full, self.until = True, time.monotonic() + FULL_RETRY_S
            self.stats.full += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "prefix store %s: the disk is full; not writing checkpoints for %.0f s at a time, "
                    "serving from memory",
                    self.dir,
                    FULL_RETRY_S,
                )
        elif full is False and self.full:
            self.full = False
            log.info("prefix store %s: writing checkpoints again", self.dir)


class Unreadable:
    """Entries of a namespace that could not be read for now (an OSError that may pass, such as EIO or a
    permission): kept on disk, logged once, tried again every RETRY_S seconds."""

    def __init__(self, directory: Path, fingerprint: bytes, block_size: int):
        self.dir, self.fingerprint, self.block_size = directory, fingerprint, block_size
        self._due: dict[str, float] = {}  # name -> when to try again (monotonic)

    def __len__(self) -> int:
        return len(self._due)

    def skip(self, name: str, exc: BaseException) -> None:
        if name not in self._due:
            log.warning("prefix store %s: cannot read %s now (%s); will retry", self.dir, name, exc)
        self._due[name] = time.monotonic() + RETRY_S

    def forget(self, name: str) -> None:
        self._due.pop(name, None)

    def due(self) -> tuple[list[str], list[str]]:
        """(names now readable, names now proven corrupt) among those due for a retry."""
        found, corrupt, now = [], [], time.monotonic()
        for name, due in list(self._due.items()):
            if due <= now:
                try:
                    entry = read_entry(self.dir / name, self.fingerprint, self.block_size)
                except OSError as exc:
                    self.skip(name, exc)
                    continue
                (found if entry is not None else corrupt).append(name)
        return found, corrupt

    def read(self, name: str) -> DiskEntry | None:
        """The entry `name`, found readable again (None if it is not, now: skipped again, or corrupt)."""
        self.forget(name)
        try:
            entry = read_entry(self.dir / name, self.fingerprint, self.block_size)
        except OSError as exc:
            self.skip(name, exc)
            return None
        if entry is not None:
            log.info("prefix store %s: %s is readable again", self.dir, name)
        return entry

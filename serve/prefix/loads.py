"""Disk hits read in the background: a lookup that finds its prefix on disk (`Hit.disk`) starts a read of the
entry (`HitLoads.start`) and the request waits; the owner checks which reads ended (`ready`, `outcome`), with
several processes takes process 0's outcome for every process, and finishes them on its own thread
(`finish`), after which the read's arrays go to `PrefixStore.attach`. The reading itself is the disk tier's
(`serve.prefix.disk.DiskReads`)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable
from typing import Any

from serve.prefix.disk import DiskReads
from serve.prefix.entries import is_transient
from serve.prefix.lookup import Hit


@dataclasses.dataclass
class Load:
    """A disk hit being read in the background."""

    hit: Hit
    future: Any
    data: Any = None  # (states, kv of the full blocks, tail kv) once read, or None if unreadable


class HitLoads:
    """The store's reads of disk hits: each started on the disk tier's reader (`reads`), and a callback
    (`on_done`) when any of them ends, so that an owner waiting for nothing but reads need not poll."""

    def __init__(self, reads: DiskReads):
        self.reads = reads
        self._done: Callable[[], None] | None = None

    def on_done(self, fn: Callable[[], None] | None) -> None:
        """Call `fn()` (from the reader thread) whenever a read started here ends; None: nobody."""
        self._done = fn

    def start(self, hit: Hit) -> Load:
        """Read a disk hit in the background (`ready`, then `finish` on the owning thread)."""
        load = Load(hit, self.reads.start(hit.disk))
        if self._done is not None:
            load.future.add_done_callback(lambda _, fn=self._done: fn())
        return load

    @staticmethod
    def ready(load: Load) -> bool:
        return load.future.done()

    @staticmethod
    def wait(loads: list[Load], timeout: float) -> None:
        """Wait up to `timeout` seconds for one of `loads` to finish."""
        cf.wait([x.future for x in loads], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @staticmethod
    def outcome(load: Load) -> tuple[bool, bool]:
        """(the finished read succeeded, it failed for a reason that may pass: the entry is kept)."""
        exc = load.future.exception()
        return exc is None, exc is not None and is_transient(exc)

    def finish(self, load: Load, leader_ok: bool | None = None, leader_transient: bool = False) -> Load:
        """The read's result in `load.data` (None: unreadable; an entry proven corrupt is dropped); waits
        for it. `leader_ok`, `leader_transient`: process 0's outcome (`outcome`), which all follow."""
        load.data = self.reads.finish(load.hit.disk, load.future, leader_ok, leader_transient)
        return load

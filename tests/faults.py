"""Faults injected into an engine's runner or its prefix store's disk reads (shared by the engine, disk and
server fault tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from serve.prefix.disk import DiskReads


def lose_pools_on_continued_prefill(monkeypatch: Any, runner: Any, on_fail: Callable[[], None] | None = None):
    """From now on a prefill call that continues a prompt (a second chunk) raises after donating the pools
    (what a device failure inside the program does; `on_fail` runs first); `rebuild` brings them back."""
    lost: list[bool] = []
    prefill_rows, rebuild = runner.prefill_rows, runner.rebuild

    def failing(reqs, ns):
        if any(r.num_computed > 0 for r in reqs):
            if on_fail is not None:
                on_fail()
            lost.append(True)
            raise RuntimeError("injected: the program failed after donating the pools")
        return prefill_rows(reqs, ns)

    def rebuilt():
        lost.clear()
        rebuild()

    monkeypatch.setattr(runner, "prefill_rows", failing)
    monkeypatch.setattr(runner, "pools_lost", lambda: bool(lost))
    monkeypatch.setattr(runner, "rebuild", rebuilt)


def block_reads(monkeypatch: Any) -> threading.Event:
    """Disk reads of the prefix store wait until the returned event is set (at most 60 s)."""
    release = threading.Event()
    read = DiskReads._read

    def slow_read(self, entry):
        assert release.wait(60)
        return read(self, entry)

    monkeypatch.setattr(DiskReads, "_read", slow_read)
    return release

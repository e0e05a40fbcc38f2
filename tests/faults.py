"""Faults injected into an engine's runner (shared by the engine and server fault tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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

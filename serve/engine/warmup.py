"""Warm start: compile an engine's programs before the first request needs them.

Without it the first request that meets a program shape (a prefill bucket, a decode batch, a block-table
width) pays its compilation, seconds each. `Warmup` compiles them one at a time, on the thread that owns
the engine, between its steps: the helpers every request meets first, then per block-table width (short
contexts first) the prefill chunks and the decode steps. Nothing it does changes a request's state: each
program is compiled ahead of time and, while no request is in the engine, run once on rows with no real
token (idle slots, the scratch block) so that its first real run is not slower either. Requests may be
served while it goes on; a program a request needs before its turn is compiled by that request as before,
and skipped here.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Protocol

from serve.engine.config import EngineShape, ProgramShape

log = logging.getLogger("jaxhybrid.warmup")


class WarmupLevel(enum.Enum):
    """Which programs to compile at start-up."""

    NONE = "none"
    DECODE = "decode"  # helpers and every decode step (prefill chunks compile on first use)
    ALL = "all"  # helpers, every prefill chunk and every decode step


class WarmupState(enum.Enum):
    WARMING = "warming"
    DONE = "done"
    TIMED_OUT = "timed_out"  # the time bound ran out: the rest compile on first use
    FAILED = "failed"  # a compile raised: logged, the rest compile on first use
    STOPPED = "stopped"  # the server shut down first


@dataclasses.dataclass(frozen=True)
class WarmupProgress:
    """What /health reports: the state, programs compiled so far of those planned, and the seconds spent."""

    level: WarmupLevel
    state: WarmupState
    compiled: int
    total: int
    elapsed_s: float

    def as_json(self) -> dict:
        return {
            "level": self.level.value,
            "state": self.state.value,
            "compiled": self.compiled,
            "total": self.total,
            "elapsed_s": round(self.elapsed_s, 3),
        }


class Compilable(Protocol):
    """What the warm-up needs of an engine."""

    shape: EngineShape

    def compile_helpers(self) -> None: ...

    def compile_program(self, program: ProgramShape) -> bool: ...


def warmup_plan(shape: EngineShape, level: WarmupLevel) -> list[ProgramShape]:
    """The model programs `level` compiles, in order: per table width (narrowest first), the prefill chunks
    and then the decode steps, so the programs of short contexts are ready first."""
    if level is WarmupLevel.NONE:
        return []
    programs = shape.decode_programs()
    if level is WarmupLevel.ALL:
        programs += shape.prefill_programs()
    return sorted(programs, key=lambda p: (p.width, p.is_decode, p.rows, p.length))


class Warmup:
    """Compiles `engine`'s programs for `level`, one per `step()` call, within `timeout_s` seconds in all
    (counted from the first step). Call `step()` only from the thread that owns the engine."""

    def __init__(
        self,
        engine: Compilable,
        level: WarmupLevel,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not timeout_s > 0:
            raise ValueError(f"the warm-up timeout must be > 0 seconds, got {timeout_s}")
        self.engine, self.level, self.timeout_s, self.clock = engine, level, timeout_s, clock
        # the helpers (None) first, then the model programs
        self.items: list[ProgramShape | None] = [] if level is WarmupLevel.NONE else [None]
        self.items += warmup_plan(engine.shape, level)
        self._done = 0
        self._started: float | None = None
        self._elapsed = 0.0
        self.state = WarmupState.WARMING if self.items else WarmupState.DONE

    @property
    def pending(self) -> bool:
        return self.state is WarmupState.WARMING

    def progress(self) -> WarmupProgress:
        elapsed = self._elapsed
        if self.pending and self._started is not None:
            elapsed = self.clock() - self._started
        return WarmupProgress(self.level, self.state, self._done, len(self.items), elapsed)

    def step(self) -> bool:
        """Compile the next program (skipping those already compiled); False once nothing is left to do."""
        if not self.pending:
            return False
        now = self.clock()
        if self._started is None:
            self._started = now
            log.info(
                "warm-up (--warmup %s): compiling the helpers and %d model programs in the background, "
                "at most %.0f s; requests are served meanwhile",
                self.level.value,
                len(self.items) - 1,
                self.timeout_s,
            )
        elif now - self._started > self.timeout_s:
            return self._finish(WarmupState.TIMED_OUT)
        item = self.items[self._done]
        try:
            if item is None:
                self.engine.compile_helpers()
            else:
                self.engine.compile_program(item)
        except Exception:  # a program that cannot compile now fails its first request instead, as before
            log.exception("warm-up: compiling an engine program failed; the rest compile on first use")
            return self._finish(WarmupState.FAILED)
        self._done += 1
        if self._done == len(self.items):
            return self._finish(WarmupState.DONE)
        return True

    def stop(self) -> None:
        """The server is shutting down: leave the rest."""
        if self.pending:
            self._finish(WarmupState.STOPPED)

    def _finish(self, state: WarmupState) -> bool:
        if self._started is not None:
            self._elapsed = self.clock() - self._started
        self.state = state
        if state is WarmupState.DONE:
            log.info("warm-up done: %d model programs compiled in %.1f s", self._done - 1, self._elapsed)
        elif state is not WarmupState.FAILED:
            log.info(
                "warm-up %s after %.1f s: %d of %d steps done; the rest compile on first use",
                "stopped at --warmup-timeout" if state is WarmupState.TIMED_OUT else "stopped at shutdown",
                self._elapsed,
                self._done,
                len(self.items),
            )
        return False

"""Warm start: compile an engine's programs before the first request needs them.

Without it the first request that meets a program shape (a prefill bucket, a decode batch, a block-table
width) pays its compilation, seconds each. `Warmup` compiles them one at a time in the order a first
request meets them (`warmup_plan`): the helpers of one row and the one-row programs of short contexts
first, so that a request sent as soon as the server answers finds them compiled or in progress. Nothing it
does changes a request's state. With the engine's tiered compile (`EngineConfig.tiered_compile`, the
server's) model programs compile on the background compile thread while the engine serves, and the plan
starts with the one-row decode step at the quick tier (a first request's program, ready in about half the
time); the helpers compile on the engine's thread meanwhile. Without it each program compiles on the
engine's thread between steps and, while no request is in the engine, runs once on rows with no real
token (idle slots, the scratch block) so that its first real run is not slower either. A program a
request needs before its turn is compiled by that request (or waited for, when it is compiling), and
skipped here.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Protocol

from serve.engine.config import EngineShape, ProgramShape
from serve.engine.executables import Tier

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
class Helpers:
    """The small programs around the model program for batches of `rows` rows (sampling, logits slicing);
    with `slot_programs`, also a slot's reset and a checkpoint's restore, which every request meets."""

    rows: tuple[int, ...]
    slot_programs: bool

    def describe(self) -> str:
        what = "sampling" + (", slot reset and restore" if self.slot_programs else "")
        return f"helpers ({what}) for {'/'.join(map(str, self.rows))} row{'' if self.rows == (1,) else 's'}"


@dataclasses.dataclass(frozen=True)
class Quick:
    """A model program at the quick tier (`Tier.QUICK`): what a first request needs, sooner."""

    program: ProgramShape


WarmupItem = Helpers | ProgramShape | Quick


def describe(item: WarmupItem, block_size: int) -> str:
    """One warm-up item in words, for the log."""
    if isinstance(item, Helpers):
        return item.describe()
    if isinstance(item, Quick):
        return describe(item.program, block_size) + " (quick tier)"
    context = f"a block table of {item.width * block_size} tokens"
    if item.is_decode:
        return f"decode, {item.rows} row{'s' if item.rows > 1 else ''}, {context}"
    return f"prefill, {item.rows} x {item.length} tokens, {context}"


@dataclasses.dataclass(frozen=True)
class WarmupProgress:
    """What /health reports: the state, programs compiled so far of those planned, the seconds spent, and
    the last program compiled (in words)."""

    level: WarmupLevel
    state: WarmupState
    compiled: int
    total: int
    elapsed_s: float
    last: str | None = None

    def as_json(self) -> dict:
        return {
            "level": self.level.value,
            "state": self.state.value,
            "compiled": self.compiled,
            "total": self.total,
            "elapsed_s": round(self.elapsed_s, 3),
            "last": self.last,
        }


class Compilable(Protocol):
    """What the warm-up needs of an engine."""

    shape: EngineShape

    def compile_helpers(self, rows: tuple[int, ...] | None = None, slot_programs: bool = True) -> None: ...

    def compile_program(self, program: ProgramShape) -> bool: ...

    def compile_in_background(self, program: ProgramShape, tier: Tier = Tier.OPTIMIZED) -> Future: ...


def first_request_key(program: ProgramShape) -> tuple[bool, int, int, int]:
    """The warm-up order of model programs: what one request meets first, first. One-row programs (a lone
    request) before batched ones (several requests at once: decode rows, packed prefill); within each, narrow
    block tables (short contexts) first, and at each width the decode step (which every generated token
    runs) before the prefill chunks, shortest first. A short first prompt thus finds the smallest prefill
    chunk and the one-row decode steps of its context among the first programs compiled."""
    return (program.rows > 1, program.width, program.length, program.rows)


def warmup_plan(shape: EngineShape, level: WarmupLevel) -> list[WarmupItem]:
    """What `level` compiles, in order (`first_request_key`): the helpers of one row, the one-row model
    programs, the helpers of the other batch sizes, the batched model programs; with the tiered compile
    (`EngineShape.tiered_compile`) the one-row decode step of the narrowest table at the quick tier first.
    An engine whose requests speculate by default compiles its verify programs beside the decode steps."""
    if level is WarmupLevel.NONE:
        return []
    programs = shape.decode_programs() + (shape.verify_programs() if shape.speculates else [])
    if level is WarmupLevel.ALL:
        programs += shape.prefill_programs()
    programs.sort(key=first_request_key)
    single = [p for p in programs if p.rows == 1]
    batched_rows = tuple(r for r in shape.decode_buckets if r > 1)
    plan: list[WarmupItem] = [Helpers((1,), slot_programs=True), *single]
    if shape.tiered_compile:
        plan.insert(0, Quick(ProgramShape(1, 1, shape.table_buckets[0])))
    if batched_rows:
        plan.append(Helpers(batched_rows, slot_programs=False))
    return plan + [p for p in programs if p.rows > 1]


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
        self.items = warmup_plan(engine.shape, level)
        self._done = self._next = 0
        self._job: tuple[WarmupItem, Future, float] | None = None  # the item on the background thread
        self._last: str | None = None
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
        return WarmupProgress(self.level, self.state, self._done, len(self.items), elapsed, self._last)

    def step(self, wait_s: float = 0.05) -> bool:
        """Advance the warm-up (skipping what is already compiled); False once nothing is left to do. On the
        background thread a model program compiles while this returns: a call waits at most `wait_s` for
        it, running the helpers on this thread meanwhile when they come next."""
        if not self.pending:
            return False
        now = self.clock()
        if self._started is None:
            self._started = now
            log.info(
                "warm-up (--warmup %s): compiling %d programs in the background, what a first request "
                "needs first, at most %.0f s; requests are served meanwhile",
                self.level.value,
                len(self.items),
                self.timeout_s,
            )
        elif now - self._started > self.timeout_s:
            return self._finish(WarmupState.TIMED_OUT)
        try:
            if self._job is not None and self._job[1].done():
                item, job, t0 = self._job
                self._job = None
                self._count(item, job.result(), t0)
            elif self._next < len(self.items):
                item = self.items[self._next]
                background = self.engine.shape.tiered_compile and not isinstance(item, Helpers)
                if background and self._job is None:
                    tier = Tier.QUICK if isinstance(item, Quick) else Tier.OPTIMIZED
                    program = item.program if isinstance(item, Quick) else item
                    self._job = (item, self.engine.compile_in_background(program, tier), self.clock())
                    self._next += 1
                elif not background:
                    self._next += 1
                    t0 = self.clock()
                    if isinstance(item, Helpers):
                        self.engine.compile_helpers(item.rows, item.slot_programs)
                        self._count(item, True, t0)
                    else:
                        self._count(item, self.engine.compile_program(item), t0)
                else:
                    wait([self._job[1]], timeout=wait_s)
            elif self._job is not None:
                wait([self._job[1]], timeout=wait_s)
        except Exception:  # a program that cannot compile now fails its first request instead, as before
            log.exception("warm-up: compiling an engine program failed; the rest compile on first use")
            return self._finish(WarmupState.FAILED)
        if self._done == len(self.items):
            return self._finish(WarmupState.DONE)
        return True

    def _count(self, item: WarmupItem, fresh: bool, t0: float) -> None:
        self._done += 1
        self._last = describe(item, self.engine.shape.block_size)
        log.info(
            "warm-up %d/%d: %s %s in %.1f s",
            self._done,
            len(self.items),
            self._last,
            "compiled" if fresh else "already compiled (a request met it first)",
            self.clock() - t0,
        )

    def stop(self) -> None:
        """The server is shutting down: leave the rest."""
        if self.pending:
            self._finish(WarmupState.STOPPED)

    def _finish(self, state: WarmupState) -> bool:
        if self._started is not None:
            self._elapsed = self.clock() - self._started
        self.state = state
        if state is WarmupState.DONE:
            log.info("warm-up done: %d programs compiled in %.1f s", self._done, self._elapsed)
        elif state is not WarmupState.FAILED:
            log.info(
                "warm-up %s after %.1f s: %d of %d steps done; the rest compile on first use",
                "stopped at --warmup-timeout" if state is WarmupState.TIMED_OUT else "stopped at shutdown",
                self._elapsed,
                self._done,
                len(self.items),
            )
        return False

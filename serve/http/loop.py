"""The engine thread of the HTTP server.

One background thread owns the engine (which is not thread-safe): it takes submissions, aborts and
queries from a command queue, calls `step()` while a step can do something (when every unfinished request
waits for a prefix read from disk, it waits on the queue: the read's end posts a wake-up there), and hands
every output to the asyncio queue of the request it belongs to (`loop.call_soon_threadsafe`). Handlers never
touch the engine. No delivery to a client (a cancelled future, a closed event loop) ever raises in this
thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from serve.engine.engine import EngineAPI
from serve.engine.requests import RequestError
from serve.engine.requests import RequestOutput as Output
from serve.engine.sampling import SamplingParams
from serve.engine.warmup import Warmup, WarmupProgress
from serve.http.errors import QueueFull, Unavailable
from serve.http.text import Event

log = logging.getLogger("jaxhybrid.server")
RATE_WINDOW_S = 10.0


class Sink:
    """A request's asyncio queue, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Event]):
        self.loop, self.queue = loop, q

    def put(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _claim(fut: concurrent.futures.Future) -> bool:
    """Mark a command's future as being worked on; False when its caller already gave up (cancelled it,
    e.g. a timed-out `/metrics` or a client that went away), so the command is skipped. A claimed future
    can no longer be cancelled, so setting its result afterwards never raises."""
    try:
        return fut.set_running_or_notify_cancel()
    except RuntimeError:  # already running or done: nobody may set it again
        return False


def _settle(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Give a claimed future its result or error; never raises in the engine thread."""
    with contextlib.suppress(concurrent.futures.InvalidStateError, RuntimeError):
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)


@dataclasses.dataclass
class _Add:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    cache_salt: str | None
    sink: Sink
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _AbortAll:
    pass


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Stop:
    pass


@dataclasses.dataclass
class _ReadDone:
    """A prefix read from disk ended (posted from the reader thread): wakes the loop to step again."""


class TokenRate:
    """Tokens generated: in all, and per second over the last RATE_WINDOW_S seconds (the metrics' gauge)."""

    def __init__(self) -> None:
        self.total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) within the window

    def add(self, n: int) -> None:
        now = time.perf_counter()
        if n:
            self.total += n
            self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def per_second(self) -> float:
        now = time.perf_counter()
        return sum(n for t, n in self._recent if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S


def snapshot(engine: Any, rate: TokenRate, healthy: bool) -> dict[str, Any]:
    """What `/metrics` and `/health` show of the engine: queue lengths, token rate, ledger and memory."""
    memory = engine.memory().to_json()
    memory.pop("requests", None)
    q = engine.queue_state()
    return {
        "running": q.running,
        "waiting": q.waiting,
        "tokens_per_second": rate.per_second(),
        "generated_tokens": rate.total,
        "healthy": healthy,
        "ledger": engine.ledger().to_json(),
        "memory": memory,
        "speculation": engine.speculation_stats().to_json(),
    }


class Subscribers:
    """Where each request's events go (its client's sink) and what it has reused so far; the engine thread
    alone calls these. A final event removes the request, so no client gets two."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._hits: dict[str, int] = {}  # prompt tokens reused, per request still running (for its abort)
        self.rate = TokenRate()

    def ids(self) -> list[str]:
        return list(self._sinks)

    def add(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink

    def end(self, request_id: str, event: Event) -> None:
        """`event` (final) to the request's client, if it still has one; the request is forgotten here."""
        self._hits.pop(request_id, None)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(event)

    def abort(self, request_id: str, hits: int | None = None) -> None:
        """The final 'abort' event, with the prompt tokens it reused (`hits`, default: as last reported)."""
        reused = self._hits.get(request_id, 0) if hits is None else hits
        self.end(request_id, Event([], [], True, "abort", reused))

    def deliver(self, out: Any) -> None:
        """One engine output to its client; a finished request is removed."""
        sink = self._sinks.get(out.request_id)
        if sink is not None:
            sink.put(
                Event(
                    list(out.new_token_ids),
                    list(out.new_logprobs),
                    out.finished,
                    out.finish_reason,
                    out.cached_tokens,
                    error=out.error,
                )
            )
        if out.finished:
            self._sinks.pop(out.request_id, None)
            self._hits.pop(out.request_id, None)
        else:
            self._hits[out.request_id] = out.cached_tokens


class EngineLoop:
    """Owns `engine` on one background thread. `max_waiting`: the most requests that may wait for a slot
    (None: no limit); a submission that would exceed it fails with QueueFull.

    Failures: a request the engine fails on its own (`finish_reason` "error") gets an error event and the
    others go on. A step that raises is logged with its cause and ends the requests it was running (the
    engine's `recover`); after `max_step_failures` failed steps with no request completed in between the
    engine is down: every request gets an error and `/health` answers 503. A step running longer than
    `stall_timeout` seconds makes `/health` answer 503 ("stalled") until it returns.

    `warmup`: stepped whenever no request is in the engine (`Warmup.step`: with the engine's tiered compile
    its model programs compile on the background thread, so a request waits at most for what it needs);
    its progress is `warmup_progress()`."""

    def __init__(
        self,
        engine: EngineAPI,
        max_waiting: int | None = None,
        *,
        stall_timeout: float = 300.0,
        max_step_failures: int = 3,
        warmup: Warmup | None = None,
        events: Any = None,
    ):
        """`events`: an `EventPublisher` given the prefix store's events after every step."""
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.max_step_failures = max_step_failures
        self.warmup, self.events = warmup, events
        self.failed: str | None = None
        self.step_failures = 0  # failed steps since a request last completed
        self.last_error: str | None = None
        self._commands: queue.Queue[Any] = queue.Queue()
        self.subscribers = Subscribers()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_started: float | None = None  # monotonic start of the step in progress
        self.rate = self.subscribers.rate

    # -- called from any thread --
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxhybrid-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def health(self) -> str | None:
        """None when healthy, else why not: down, stopping, or a step stalled for over `stall_timeout`."""
        if self.failed is not None:
            return self.failed
        if not self.alive:
            return "the engine is not running"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_timeout:
            return f"stalled: the current engine step has run for {time.monotonic() - started:.0f} s"
        return None

    def warmup_progress(self) -> WarmupProgress | None:
        """The warm-up's progress, or None when the server has none."""
        return None if self.warmup is None else self.warmup.progress()

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None,
        sink: Sink,
    ) -> concurrent.futures.Future:
        """Queue a request; the future gives its id, or raises RequestError / QueueFull / Unavailable."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive or self.failed is not None:
            fut.set_exception(Unavailable(self.failed or "the engine is not running"))
        else:
            self._commands.put(_Add(list(prompt_ids), params, request_id, cache_salt, sink, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Cancel every queued and running request (each gets a final event with finish_reason 'abort')."""
        self._commands.put(_AbortAll())

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():
            fut.set_exception(Unavailable("the engine is not running"))
        else:
            self._commands.put(_Call(fn, fut))
        return fut

    def snapshot(self) -> concurrent.futures.Future:
        """Queue lengths, token rate, ledger and memory, taken on the engine thread."""
        return self.call(lambda engine: snapshot(engine, self.rate, self.health() is None))

    def stop(self, timeout: float = 60.0) -> None:
        """Abort whatever is still queued or running, flush pending saves (`Engine.flush`), end the thread."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s", timeout)

    @property
    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (and so may still deliver events)."""
        return self._thread is not None and self._thread.is_alive()

    # -- engine thread --
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug outside any one command or step: no client may wait forever
            log.exception("the engine thread failed")
            self._refuse_queued(self._go_down(f"the engine thread failed: {type(exc).__name__}: {exc}"))

    def _serve(self) -> None:
        """Step while a step can do something; otherwise wait for a command (or for a prefix read to end,
        when the only unfinished requests wait for one), compiling warm-up programs while idle."""
        engine = self.engine
        engine.on_read_done(lambda: self._commands.put(_ReadDone()))
        while True:
            busy = self.failed is None and engine.has_unfinished()
            warming = not busy and self.failed is None and self.warmup is not None and self.warmup.pending
            stepping = busy and not engine.waits_for_reads()
            commands = [] if stepping or warming else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                try:
                    self._handle(cmd)
                except Exception:  # a bug in a command must not end the loop
                    log.exception("engine command %s failed", type(cmd).__name__)
            if self._stopping:
                self._shutdown()
                return
            if self.failed is None and engine.has_unfinished():
                if not engine.waits_for_reads():
                    self._step()
            elif warming:
                self._warm()

    def _warm(self) -> None:
        """One warm-up compile; it counts as a step for the stall check."""
        self._step_started = time.monotonic()
        try:
            self.warmup.step()
        finally:
            self._step_started = None

    def _step(self) -> None:
        self._step_started = time.monotonic()
        recovered = False
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or a device failure that no single request caused
            recovered = True
            self.step_failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("engine step failed (%d since a request last completed)", self.step_failures)
            if self.step_failures >= self.max_step_failures:
                n = self.step_failures
                self._go_down(f"the engine failed {n} steps with no request completed: {self.last_error}")
                return
            try:
                outputs = self.engine.recover(self.last_error)
            except Exception as rexc:
                log.exception("the engine could not recover from the failed step")
                self._go_down(f"the engine could not recover: {type(rexc).__name__}: {rexc}")
                return
        finally:
            self._step_started = None
        if any(o.finished and o.finish_reason in ("stop", "length") for o in outputs):
            self.step_failures = 0  # the engine completes requests again: earlier failures were transient
        if self.events is not None:
            self.events.publish(self.engine.take_events())
        self._deliver(outputs)
        if recovered:
            self._end_orphans()

    def _end_orphans(self) -> None:
        """After a failed step, an error event for every request the engine no longer serves."""
        active = {r.id for r in self.engine.active_requests()}
        lost = [
            Output(rid, [], [], True, "error", error="lost in a failed engine step")
            for rid in self.subscribers.ids()
        ]
        self._deliver([o for o in lost if o.request_id not in active])

    def _go_down(self, reason: str) -> str:
        """The engine is down for good: every request gets an error, new ones get 503; returns `reason`."""
        log.error("%s; the server answers 503 until restarted", reason)
        self.failed = reason
        for rid in self.subscribers.ids():
            self.subscribers.end(rid, Event([], [], True, "error", error=reason))
        return reason

    def _handle(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            self.subscribers.abort(cmd.request_id)
            engine.forget(cmd.request_id)
        elif isinstance(cmd, _AbortAll):
            self._abort_all()
        elif isinstance(cmd, _Call):
            if not _claim(cmd.future):
                return
            try:
                result = cmd.fn(engine)
            except Exception as exc:
                _settle(cmd.future, error=exc)
            else:
                _settle(cmd.future, result)
        elif isinstance(cmd, _Stop):
            self._stopping = True

    def _add(self, cmd: _Add) -> None:
        engine = self.engine
        if not _claim(cmd.future):
            return  # the client went away before its request was queued: nothing to serve
        if self._stopping or self.failed is not None:
            _settle(cmd.future, error=Unavailable(self.failed or "the server is shutting down"))
            return
        if self.max_waiting is not None:
            q = engine.queue_state()
            if q.waiting + 1 - q.free_slots > self.max_waiting:
                message = (
                    f"server busy: {q.running} requests running and {q.waiting} waiting "
                    f"(at most {self.max_waiting} may wait); retry"
                )
                _settle(cmd.future, error=QueueFull(message))
                return
        try:
            engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, cache_salt=cmd.cache_salt)
        except RequestError as exc:
            _settle(cmd.future, error=exc)
            return
        except Exception as exc:  # unexpected: a server error for this request only, keep serving
            log.exception("add_request failed")
            _settle(cmd.future, error=exc)
            return
        self.subscribers.add(cmd.request_id, cmd.sink)
        _settle(cmd.future, cmd.request_id)

    def _deliver(self, outputs: Sequence[Any]) -> None:
        self.rate.add(sum(len(o.new_token_ids) for o in outputs))
        for out in outputs:
            self.subscribers.deliver(out)
            if out.finished:
                self.engine.forget(out.request_id)

    def _abort_all(self) -> None:
        engine = self.engine
        for req in engine.active_requests():
            engine.abort(req.id)
            self.subscribers.abort(req.id, req.prefix_hit_tokens)
            engine.forget(req.id)

    def _shutdown(self) -> None:
        engine = self.engine
        if self.warmup is not None:
            self.warmup.stop()
        try:
            self._abort_all()
        except Exception:
            log.exception("aborting the remaining requests failed")
        flush = getattr(engine, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception:
                log.exception("flushing the prefix store failed")
        self._refuse_queued("the server is shutting down")

    def _refuse_queued(self, reason: str) -> None:
        """Answer every queued submission and call with Unavailable (the thread is ending)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add | _Call) and _claim(cmd.future):
                _settle(cmd.future, error=Unavailable(reason))

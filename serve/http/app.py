"""OpenAI-compatible HTTP server over the engine's incremental interface.

One background thread owns the `Engine` (which is not thread-safe): it takes submissions, aborts and
queries from a command queue, calls `step()` while work exists, and hands every `RequestOutput` to the
asyncio queue of the request it belongs to (`loop.call_soon_threadsafe`). Handlers never touch the
engine: requests only wait for each other as much as the engine's batching makes them.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid fields,
values, an unknown model or a prompt over the context; 429 when more than `max_waiting` requests would
wait for a slot; 503 when the engine is down or stopping; never a traceback in a body.

A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its request
aborted, which frees its slot and KV blocks at the engine's next command round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _StarletteJSONResponse
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine.engine import Engine, RequestError, check_cache_salt
from serve.engine.sampling import SamplingError, SamplingParams
from serve.http.metrics import ServerMetrics

log = logging.getLogger("jaxhybrid.server")

RATE_WINDOW_S = 10.0
DISCONNECT_POLL_S = 0.5


# --- errors ---------------------------------------------------------------------------------------------
class JSONResponse(_StarletteJSONResponse):
    """JSON with non-ASCII characters escaped: text taken from a request (a field name, a model id) may
    hold lone surrogates, which UTF-8 cannot encode but a \\uXXXX escape can."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _show(value: Any, limit: int = 80) -> str:
    """A short, printable rendering of a client's value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class APIError(Exception):
    """An error answered as OpenAI JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class QueueFull(Exception):
    """More requests would wait for a slot than the server allows."""


class Unavailable(Exception):
    """The engine loop is stopping or has failed."""


# --- the engine thread ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Event:
    """What the engine thread tells one request: new tokens, and whether (and why) it finished."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0
    error: str | None = None


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


class EngineLoop:
    """Owns `engine` on one background thread. `max_waiting`: the most requests that may wait for a slot
    (None: no limit); a submission that would exceed it fails with QueueFull.

    Failures: a request the engine fails on its own (`finish_reason` "error") gets an error event and the
    others go on. A step that raises is logged with its cause and ends the requests it was running (the
    engine's `recover`); after `max_step_failures` failed steps with no request completed in between the
    engine is down: every request gets an error and `/health` answers 503. A step running longer than
    `stall_timeout` seconds makes `/health` answer 503 ("stalled") until it returns."""

    def __init__(
        self,
        engine: Any,
        max_waiting: int | None = None,
        *,
        stall_timeout: float = 300.0,
        max_step_failures: int = 3,
    ):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.max_step_failures = max_step_failures
        self.failed: str | None = None
        self.step_failures = 0  # failed steps since a request last completed
        self.last_error: str | None = None
        self._commands: queue.Queue[Any] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._rate: deque[tuple[float, int]] = deque()
        self.generated_tokens = 0

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
        return self.call(self._snapshot)

    def stop(self, timeout: float = 60.0) -> None:
        """Abort whatever is still queued or running, flush pending saves (`Engine.flush`), end the thread."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s", timeout)

    # -- engine thread --
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = self.failed is None and engine.has_unfinished()
            commands = [] if busy else [self._commands.get()]
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
                self._step()

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or a device failure that no single request caused
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
        self._deliver(outputs)

    def _go_down(self, reason: str) -> None:
        """The engine is down for good: every request gets an error, new ones get 503."""
        log.error("%s; the server answers 503 until restarted", reason)
        self.failed = reason
        for rid in list(self._sinks):
            self._sinks.pop(rid).put(Event([], [], True, "error", error=reason))

    def _handle(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            req = engine.requests.get(cmd.request_id)
            hit = req.prefix_hit_tokens if req is not None else 0
            if req is not None:
                engine.abort(cmd.request_id)
            sink = self._sinks.pop(cmd.request_id, None)
            if sink is not None:
                sink.put(Event([], [], True, "abort", hit))
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
            would_wait = len(engine.waiting) + 1 - len(engine.free_slots)
            if would_wait > self.max_waiting:
                message = (
                    f"server busy: {len(engine.running)} requests running and {len(engine.waiting)} "
                    f"waiting (at most {self.max_waiting} may wait); retry"
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
        self._sinks[cmd.request_id] = cmd.sink
        _settle(cmd.future, cmd.request_id)

    def _deliver(self, outputs: Sequence[Any]) -> None:
        now = time.perf_counter()
        n = sum(len(o.new_token_ids) for o in outputs)
        if n:
            self.generated_tokens += n
            self._rate.append((now, n))
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
        for out in outputs:
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
                self.engine.forget(out.request_id)

    def _snapshot(self, engine: Any) -> dict[str, Any]:
        now = time.perf_counter()
        recent = sum(n for t, n in self._rate if t >= now - RATE_WINDOW_S)
        memory = engine.memory()
        memory.pop("requests", None)
        return {
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "tokens_per_second": recent / RATE_WINDOW_S,
            "generated_tokens": self.generated_tokens,
            "healthy": self.health() is None,
            "ledger": engine.ledger(),
            "memory": memory,
        }

    def _abort_all(self) -> None:
        engine = self.engine
        for req in engine.active_requests():
            engine.abort(req.id)
            sink = self._sinks.pop(req.id, None)
            if sink is not None:
                sink.put(Event([], [], True, "abort", req.prefix_hit_tokens))
            engine.forget(req.id)

    def _shutdown(self) -> None:
        engine = self.engine
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
        while True:  # answer whatever arrived meanwhile
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add | _Call) and _claim(cmd.future):
                _settle(cmd.future, error=Unavailable("the server is shutting down"))


# --- text: incremental detokenisation and stop strings --------------------------------------------------
def _decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """tokenizer.decode, skipping special tokens where the tokenizer can."""
    try:
        params = inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        params = {}
    if "skip_special" in params:
        return lambda ids: tokenizer.decode(list(ids), skip_special=True)
    return lambda ids: tokenizer.decode(list(ids))


class Tracker:
    """One request's output: token ids, logprobs, the text (decoded incrementally, trimmed at a stop
    string), and what of it has been handed out already."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None, stop: Sequence[str]):
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []  # every generated token (usage, logprobs)
        self.text_ids: list[int] = []  # those that make up the text (not a final stop / eos token)
        self.logprobs: list[float] = []
        self.text = ""
        self.sent = 0  # characters of text handed out
        self.sent_tokens = 0  # tokens whose logprobs were handed out
        self._prefix = 0  # detokeniser window: text_ids[_prefix:_read] were decoded last time
        self._read = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.engine_done = False  # the engine finished (or aborted) the request itself
        self.cached_tokens = 0
        self.error: str | None = None

    def _detok(self, final: bool = False) -> str:
        if self.decode is None:
            return ""
        prefix = self.decode(self.text_ids[self._prefix : self._read])
        full = self.decode(self.text_ids[self._prefix :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, len(self.text_ids)
        return full[len(prefix) :]

    def _add_text(self, new: str) -> bool:
        start = max(0, len(self.text) - self.hold)
        self.text += new
        if not self.stop or not new:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def feed(self, ev: Event) -> None:
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.error is not None:
            self.error = ev.error
        if self.finished:
            return
        n = len(ev.token_ids)
        for i, tok in enumerate(ev.token_ids):
            self.ids.append(int(tok))
            self.logprobs.append(float(ev.logprobs[i]) if i < len(ev.logprobs) else 0.0)
            if i == n - 1 and ev.finished and ev.finish_reason == "stop":
                break  # the end-of-sequence / stop token: counted, not shown
            self.text_ids.append(int(tok))
            if self._add_text(self._detok()):
                self.finished, self.finish_reason = True, "stop"
                return
        if ev.finished:
            self.engine_done = True
            self.finished, self.finish_reason = True, ev.finish_reason
            if self._read < len(self.text_ids) and self._add_text(self._detok(final=True)):
                self.finish_reason = "stop"

    def take_text(self) -> str:
        """Text not handed out yet; while running, the last `hold` characters stay back (a stop string
        may be starting there)."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def take_tokens(self) -> tuple[list[int], list[float]]:
        ids, lps = self.ids[self.sent_tokens :], self.logprobs[self.sent_tokens :]
        self.sent_tokens = len(self.ids)
        return ids, lps


# --- request parsing --------------------------------------------------------------------------------------
# Fields the OpenAI API defines that do not change what this server computes: accepted (type-checked) and
# ignored, so unchanged clients work.
IGNORED_OPENAI_FIELDS = {
    "user": str,
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "logit_bias": dict,
    "service_tier": str,
    "store": bool,
    "metadata": dict,
    "parallel_tool_calls": bool,
}
MAX_BODY_BYTES = 16 * 2**20
OFFLOAD_BYTES = 64 * 2**10  # bodies larger than this are decoded and tokenised off the event loop

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "logprobs",
    "ignore_eos",
    "cache_salt",
    "stream",
    "stream_options",
    "return_token_ids",
} | set(IGNORED_OPENAI_FIELDS)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


@dataclasses.dataclass
class Prepared:
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    cache_salt: str | None
    return_token_ids: bool = False


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


MAX_JSON_DEPTH = 32  # a request body nests a few levels (messages -> content parts); deeper is refused
MAX_STOP_CHARS = 1024


def decode_body(raw: bytes) -> Any:
    """The JSON document of a request body, or a 400 APIError: not UTF-8, not JSON, nested deeper than
    MAX_JSON_DEPTH, or holding text UTF-8 cannot encode (lone surrogates), in a value or a field name."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from (
            None
        )
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and integers of > 4300 digits
        raise _bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    stack: list[tuple[Any, int, str | None]] = [(body, 0, None)]
    while stack:  # iterative: the document may be nested up to the parser's recursion limit
        node, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", field, "invalid_json")
        if isinstance(node, str):
            _check_text(node, field)
        elif isinstance(node, dict):
            for key, value in node.items():
                _check_text(key, field if depth else None)
                stack.append((value, depth + 1, key if depth == 0 else field))
        elif isinstance(node, list):
            stack.extend((value, depth + 1, field) for value in node)
    return body


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = f"'{field}'" if field is not None else "a field name"
        raise _bad(f"{where} holds text that is not valid Unicode (a lone surrogate)", field) from None


def _get_int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {_show(v)}", name, "invalid_type")
    return v


def _get_float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(f"'{name}' must be a number, got {_show(v)}", name, "invalid_type")
    return float(v)


def _get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be true or false, got {_show(v)}", name, "invalid_type")
    return v


class RequestParser:
    """Turns a JSON body into a `Prepared` request or an APIError naming the field."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str, default_max_tokens: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab = engine.model_config.vocab_size
        self.context = engine.max_model_len
        self.default_max_tokens = default_max_tokens
        self.eos = engine.model_config.eos_token_id

    def _check_fields(self, body: dict, allowed: set[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise _bad(f"unknown field '{unknown[0]}'", unknown[0], "unknown_field")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                400,
                f"the model '{model}' does not exist here; this server serves '{self.model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        for name, kind in IGNORED_OPENAI_FIELDS.items():
            v = body.get(name)
            if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
                raise _bad(f"'{name}' has the wrong type", name, "invalid_type")
        neutral = {
            "n": (1,),
            "best_of": (1,),
            "echo": (False,),
            "suffix": ("",),
            "top_logprobs": (0,),
        }
        for name, ok in neutral.items():
            v = body.get(name)
            if v is not None and not any(v == o and type(v) is type(o) for o in ok):
                raise _bad(f"'{name}' = {_show(v)} is not supported (allowed: {ok[0]!r})", name)

    def _stop(self, body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
        stop = body.get("stop")
        items = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
        if isinstance(stop, bool) or not isinstance(items, list):
            raise _bad("'stop' must be a string, a token id or a list of them", "stop", "invalid_type")
        strings, ids = [], []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise _bad("'stop' strings must not be empty", "stop")
                if len(item) > MAX_STOP_CHARS:
                    raise _bad(f"'stop' strings may be at most {MAX_STOP_CHARS} characters", "stop")
                strings.append(item)
            elif _is_int(item):
                ids.append(item)
            else:
                raise _bad(f"'stop' entries must be strings or token ids, got {_show(item)}", "stop")
        extra = body.get("stop_token_ids")
        if extra is not None:
            if not isinstance(extra, list) or not all(_is_int(t) for t in extra):
                raise _bad("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
            ids += extra
        if len(strings) + len(ids) > 16:
            raise _bad("at most 16 stop sequences", "stop")
        if strings and self.tokenizer is None:
            raise _bad("stop strings need a tokenizer, which this model lacks: use token ids", "stop")
        return tuple(strings), tuple(dict.fromkeys(ids))

    def _prompt_ids(self, body: dict) -> list[int]:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt", "missing_field")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) != 1:
                raise _bad("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise _bad("this model has no tokenizer: send the prompt as token ids", "prompt")
            try:
                ids = self.tokenizer.encode(prompt)
            except Exception as exc:  # noqa: BLE001 - text the tokenizer cannot take is the client's problem
                raise _bad(f"the prompt could not be tokenized: {exc}", "prompt") from None
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise _bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise _bad(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})", "prompt")
        return ids

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"{where} must be an object", where, "invalid_type")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role:
                raise _bad(f"{where}.role must be a non-empty string", f"{where}.role")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"):
                        raise _bad(f"{where}.content: only text parts are supported", f"{where}.content")
                    if not isinstance(part.get("text"), str):
                        raise _bad(f"{where}.content: a text part needs 'text'", f"{where}.content")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
            clean.append({**m, "role": role, "content": content})
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer, so no chat template: use /v1/completions", "messages")
        from jaxhybrid.tokenizer import TokenizerError

        try:
            ids = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
        except TokenizerError as exc:
            raise _bad(str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template could not render these messages
            log.warning("the chat template failed on a request: %s: %s", type(exc).__name__, exc)
            raise _bad(f"the conversation could not be rendered: {exc}", "messages") from None
        if not ids:
            raise _bad("the rendered conversation is empty", "messages")
        return list(ids)

    def parse(self, body: Any, kind: str) -> Prepared:
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        self._check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
        prompt = self._prompt_ids(body) if kind == "completion" else self._chat_ids(body)
        room = self.context - len(prompt)
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {len(prompt)} tokens; this model's context is {self.context} tokens, "
                "which leaves no room to generate",
                "invalid_request_error",
                "messages" if kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        name = "max_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            name = "max_completion_tokens"
        max_tokens = _get_int(body, name, None)
        if max_tokens is None:
            max_tokens = min(16 if kind == "completion" else self.default_max_tokens, room)
        elif max_tokens < 1:
            raise _bad(f"'{name}' must be at least 1, got {max_tokens}", name)
        elif max_tokens > room:
            raise APIError(
                400,
                f"the prompt ({len(prompt)} tokens) + {name} ({max_tokens}) = {len(prompt) + max_tokens} "
                f"exceeds this model's context of {self.context} tokens",
                "invalid_request_error",
                name,
                "context_length_exceeded",
            )
        stop, stop_ids = self._stop(body)
        top_k = _get_int(body, "top_k", 0)
        logprobs_v = body.get("logprobs")
        if kind == "completion":
            if logprobs_v is not None and (isinstance(logprobs_v, bool) or not _is_int(logprobs_v)):
                raise _bad("'logprobs' must be an integer (0 or 1) or null", "logprobs", "invalid_type")
            if logprobs_v is not None and not 0 <= logprobs_v <= 1:
                raise _bad(
                    "'logprobs' must be 0 or 1: only the sampled token's log-probability is reported",
                    "logprobs",
                )
            logprobs = logprobs_v is not None
        else:
            logprobs = _get_bool(body, "logprobs", False)
        stream = _get_bool(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise _bad("'stream_options' needs 'stream': true", "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise _bad("'stream_options' may only hold 'include_usage'", "stream_options")
            include_usage = _get_bool(options, "include_usage", False)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise _bad("'cache_salt' must be a non-empty string", "cache_salt", "invalid_type")
        try:
            check_cache_salt(salt)
        except RequestError as exc:
            raise _bad(str(exc), "cache_salt") from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_get_float(body, "temperature", 1.0),
            top_k=0 if top_k == -1 else top_k,
            top_p=_get_float(body, "top_p", 1.0),
            seed=_get_int(body, "seed", None),
            stop_token_ids=stop_ids,
            ignore_eos=_get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
        )
        try:
            params.validate(self.vocab)
        except SamplingError as exc:
            field = str(exc).split(" ", 1)[0]
            param = "stop" if field == "stop_token_ids" else field
            raise _bad(str(exc), param) from None
        return_ids = _get_bool(body, "return_token_ids", False)
        return Prepared(kind, prompt, params, stop, stream, include_usage, logprobs, salt, return_ids)


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends, even when the client went away
    before the body iterator was first entered (its own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# --- the app ----------------------------------------------------------------------------------------------
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Server:
    """Request handling around one EngineLoop (see `create_app`)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        *,
        max_waiting: int | None = 64,
        default_max_tokens: int = 1024,
        max_body_bytes: int = MAX_BODY_BYTES,
        stall_timeout: float = 300.0,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.loop = EngineLoop(engine, max_waiting, stall_timeout=stall_timeout)
        self.parser = RequestParser(engine, tokenizer, model_name, default_max_tokens)
        self.metrics = ServerMetrics()
        self.decode = _decoder(tokenizer) if tokenizer is not None else None
        self.created = int(time.time())
        self.max_body_bytes = max_body_bytes

    # -- helpers --
    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body exceeds {self.max_body_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    def count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    def token_text(self, tok: int) -> str:
        if self.decode is None:
            return f"token_id:{tok}"
        text = self.decode([tok])
        return text if text and "\ufffd" not in text else f"token_id:{tok}"

    def completion_logprobs(self, ids: list[int], lps: list[float], offset: int) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += 0 if t.startswith("token_id:") else len(t)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any]:
        content = []
        for t, lp in zip(ids, lps, strict=True):
            text = self.token_text(t)
            content.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
            )
        return {"content": content}

    def usage(self, prep: Prepared, tr: Tracker) -> dict[str, Any]:
        n = len(prep.prompt_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": len(tr.ids),
            "total_tokens": n + len(tr.ids),
            "prompt_tokens_details": {"cached_tokens": min(tr.cached_tokens, n)},
        }

    async def submit(self, prep: Prepared, rid: str) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        fut = self.loop.submit(
            prep.prompt_ids, prep.params, rid, prep.cache_salt, Sink(asyncio.get_running_loop(), q)
        )
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # queued after all (the engine claimed it before the cancel): abort it once it is in
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or self.loop.abort(rid))
            raise
        except RequestError as exc:
            raise _bad(str(exc), "prompt") from None
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", None, "queue_full") from None
        except Unavailable as exc:
            raise APIError(
                503, f"the engine is unavailable: {exc}", "server_error", None, "unavailable"
            ) from None
        return q

    # -- non-streaming --
    async def run_blocking(self, prep: Prepared, request: Request, endpoint: str, t0: float) -> JSONResponse:
        rid = f"{'cmpl' if prep.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        q = await self.submit(prep, rid)
        tr = Tracker(self.decode, prep.stop)
        t_first = None
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while not tr.finished:
                try:
                    ev = q.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        ev = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        ev = None
                if time.monotonic() >= next_check:  # tokens may flow all the time: look at the clock
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        log.info("%s: client went away, aborting", rid)
                        self.count(endpoint, 499)
                        return JSONResponse(error_body("client disconnected", "client_error"), 499)
                if ev is None:
                    continue
                if t_first is None and ev.token_ids:
                    t_first = time.perf_counter()
                tr.feed(ev)
        finally:
            if not tr.engine_done:
                self.loop.abort(rid)
        if tr.error is not None:
            raise APIError(
                500, "the engine failed while serving this request", "server_error", None, "engine"
            )
        text = tr.take_text()
        lp = None
        if prep.logprobs:
            lp = (
                self.completion_logprobs(tr.ids, tr.logprobs, 0)
                if prep.kind == "completion"
                else self.chat_logprobs(tr.ids, tr.logprobs)
            )
        if prep.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": tr.finish_reason}
            obj = "text_completion"
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": tr.finish_reason,
            }
            obj = "chat.completion"
        if prep.return_token_ids:
            choice["token_ids"] = list(tr.ids)
        body = {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self.usage(prep, tr),
        }
        self.record(endpoint, prep, tr, t0, t_first)
        return JSONResponse(body)

    def record(self, endpoint: str, prep: Prepared, tr: Tracker, t0: float, t_first: float | None) -> None:
        now = time.perf_counter()
        self.count(endpoint, 200)
        self.metrics.finish(
            endpoint,
            now - t0,
            None if t_first is None else t_first - t0,
            len(prep.prompt_ids),
            len(tr.ids),
            min(tr.cached_tokens, len(prep.prompt_ids)),
            None if t_first is None else now - t_first,
        )

    # -- streaming --
    async def run_stream(self, prep: Prepared, endpoint: str, t0: float) -> StreamingResponse:
        rid = f"{'cmpl' if prep.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        q = await self.submit(prep, rid)  # errors (400/429/503) before any byte is sent
        created = int(time.time())
        obj = "text_completion" if prep.kind == "completion" else "chat.completion.chunk"

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": [] if choice is None else [choice],
            }
            if prep.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def choice(
            text: str, lp: Any, finish: str | None, ids: list[int] | None = None, role: bool = False
        ) -> dict[str, Any]:
            if prep.kind == "completion":
                out = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            else:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
                if text:
                    delta["content"] = text
                out = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if prep.return_token_ids and ids is not None:
                out["token_ids"] = ids
            return out

        tr = Tracker(self.decode, prep.stop)

        async def events() -> AsyncIterator[str]:
            t_first = None
            offset = 0
            completed = False
            try:
                if prep.kind == "chat":
                    yield chunk(choice("", None, None, role=True))
                while not tr.finished:
                    ev = await q.get()
                    if t_first is None and ev.token_ids:
                        t_first = time.perf_counter()
                    tr.feed(ev)
                    if tr.error is not None:
                        err = error_body("the engine failed while serving this request", "server_error")
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    text = tr.take_text()
                    ids, lps = tr.take_tokens()
                    lp = None
                    if prep.logprobs and ids:
                        if prep.kind == "completion":
                            lp = self.completion_logprobs(ids, lps, offset)
                        else:
                            lp = self.chat_logprobs(ids, lps)
                    offset += len(text)
                    if text or tr.finished or (ids and (prep.logprobs or prep.return_token_ids)):
                        yield chunk(choice(text, lp, tr.finish_reason if tr.finished else None, ids))
                if prep.include_usage and tr.error is None:
                    yield chunk(None, self.usage(prep, tr))
                yield "data: [DONE]\n\n"
                completed = tr.error is None
            finally:
                if not tr.engine_done:
                    self.loop.abort(rid)
                if completed:
                    self.record(endpoint, prep, tr, t0, t_first)
                else:
                    self.count(endpoint, 499 if tr.error is None else 500)

        return EventStream(events(), on_close=lambda: tr.engine_done or self.loop.abort(rid))

    async def read_body(self, request: Request) -> bytes:
        """The body, read as it arrives and refused (413) once it passes `max_body_bytes`, whether its size
        was declared (Content-Length) or not (a chunked upload). The rest of an oversized upload is read
        and dropped (up to 4x the limit) so the client gets the answer instead of a reset connection."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.too_large()
        chunks, size = [], 0
        stream = request.stream()
        async for chunk in stream:
            size += len(chunk)
            if size > self.max_body_bytes:
                async for rest in stream:
                    size += len(rest)
                    if size > 5 * self.max_body_bytes:
                        break
                raise self.too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def prepare(self, raw: bytes, kind: str) -> Prepared:
        """Body bytes -> a validated request (APIError 400 naming the problem otherwise)."""
        return self.parser.parse(decode_body(raw), kind)

    async def generate(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        endpoint = request.url.path
        raw = await self.read_body(request)
        if len(raw) > OFFLOAD_BYTES:  # decoding and tokenising a large body would stall every stream
            prep = await asyncio.to_thread(self.prepare, raw, kind)
        else:
            prep = self.prepare(raw, kind)
        if prep.stream:
            return await self.run_stream(prep, endpoint, t0)
        return await self.run_blocking(prep, request, endpoint, t0)


class ConnectionLimit:
    """ASGI middleware: at most `limit` HTTP requests in progress (a stream counts until it ends); one more
    is answered at once with a 503 in the OpenAI error shape. /health and /metrics are never refused, so
    probes still see a full server."""

    EXEMPT = ("/health", "/metrics")

    def __init__(self, app: Any, limit: int, count: Callable[[str, int], None]):
        if limit < 1:
            raise ValueError(f"the connection limit must be >= 1, got {limit}")
        self.app, self.limit, self.count = app, limit, count
        self.active = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.EXEMPT:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            self.count(scope.get("path", ""), 503)
            body = error_body(
                f"too many requests in progress (at most {self.limit}); retry later",
                "server_error",
                None,
                "too_many_connections",
            )
            await JSONResponse(body, status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def create_app(
    engine: Engine,
    tokenizer: Any,
    model_name: str,
    *,
    max_waiting: int | None = 64,
    default_max_tokens: int = 1024,
    stop_timeout: float = 60.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_connections: int | None = 1024,
    stall_timeout: float = 300.0,
) -> FastAPI:
    """The OpenAI-compatible app. The engine loop starts with the app's lifespan and stops (aborting what
    is left, flushing pending saves) when it ends. `max_waiting`: requests that may wait for a slot before
    new ones get 429 (None: unlimited). `default_max_tokens`: chat completions without max_tokens generate
    up to this many (or what the context leaves). `max_connections`: HTTP requests in progress at once
    (streams included); one more gets 503 (None: unlimited). `stall_timeout`: seconds an engine step may
    run before /health reports the engine stalled."""
    server = Server(
        engine,
        tokenizer,
        model_name,
        max_waiting=max_waiting,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        stall_timeout=stall_timeout,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        log.info("serving '%s' (context %d tokens)", model_name, engine.max_model_len)
        try:
            yield
        finally:
            log.info("stopping the engine: aborting unfinished requests, flushing the prefix store")
            await asyncio.to_thread(server.loop.stop, stop_timeout)

    app = FastAPI(title="jaxhybrid", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if max_connections is not None:
        app.add_middleware(ConnectionLimit, limit=max_connections, count=server.count)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        server.count(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.count(request.url.path, exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(message, kind, None, str(exc.status_code)), status_code=exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.count(request.url.path, 400)
        return JSONResponse(error_body("invalid request", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        server.count(request.url.path, 500)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        server.count("/v1/models", 200)
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "jaxhybrid",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = server.loop.health()
        if reason is not None:
            server.count("/health", 503)
            return JSONResponse(error_body(reason, "server_error", None, "unavailable"), status_code=503)
        server.count("/health", 200)
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            snap = await asyncio.wait_for(asyncio.wrap_future(server.loop.snapshot()), 10.0)
            server.metrics.engine.snapshot = snap
        except (TimeoutError, Unavailable):
            pass  # keep the last snapshot
        server.count("/metrics", 200)
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

"""OpenAI-compatible HTTP server over the engine's incremental interface.

One background thread owns the `Engine` (which is not thread-safe): it takes submissions, aborts and
queries from a command queue, calls `step()` while work exists, and hands every `RequestOutput` to the
asyncio queue of the request it belongs to (`loop.call_soon_threadsafe`). Handlers never touch the
engine: requests only wait for each other as much as the engine's batching makes them.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), GET /v1/models, GET /health (200 with status "ok", or "warming" while the
start-up warm-up compiles programs; 503 when the engine is down or a step stalled), GET /metrics (Prometheus).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid fields,
values, an unknown model or a prompt over the context; 429 when more than `max_waiting` requests would
wait for a slot; 503 when the engine is down or stopping; never a traceback in a body.

A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its request
aborted, which frees its slot and KV blocks at the engine's next command round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine.engine import EngineAPI
from serve.engine.requests import RequestError
from serve.engine.warmup import Warmup, WarmupState
from serve.http.errors import APIError, JSONResponse, QueueFull, Unavailable, error_body
from serve.http.loop import EngineLoop, Event, Sink
from serve.http.metrics import ServerMetrics
from serve.http.parsing import MAX_BODY_BYTES, OFFLOAD_BYTES, Prepared, RequestParser, bad, decode_body
from serve.http.text import Tracker, decoder

DISCONNECT_POLL_S = 0.5
log = logging.getLogger("jaxhybrid.server")


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
        engine: EngineAPI,
        tokenizer: Any,
        model_name: str,
        *,
        max_waiting: int | None = 64,
        default_max_tokens: int = 1024,
        max_body_bytes: int = MAX_BODY_BYTES,
        stall_timeout: float = 300.0,
        warmup: Warmup | None = None,
        events: Any = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.loop = EngineLoop(engine, max_waiting, stall_timeout=stall_timeout, warmup=warmup, events=events)
        self.parser = RequestParser(engine, tokenizer, model_name, default_max_tokens)
        self.metrics = ServerMetrics()
        self.decode = decoder(tokenizer) if tokenizer is not None else None
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
            raise bad(str(exc), "prompt") from None
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", None, "queue_full") from None
        except Unavailable as exc:
            raise APIError(
                503, f"the engine is unavailable: {exc}", "server_error", None, "unavailable"
            ) from None
        return q

    async def next_event(self, q: asyncio.Queue[Event]) -> Event | None:
        """The request's next event, or None after DISCONNECT_POLL_S without one. Once the engine thread
        has ended (and a further poll brought nothing it had sent), a final error event: no other can come."""
        for _ in range(2):
            try:
                return await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if self.loop.thread_alive:
                    return None
        return Event([], [], True, "error", error="the engine thread ended")

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
                    ev = await self.next_event(q)
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
                    ev = await self.next_event(q)
                    if ev is None:
                        continue
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
    engine: EngineAPI,
    tokenizer: Any,
    model_name: str,
    *,
    max_waiting: int | None = 64,
    default_max_tokens: int = 1024,
    stop_timeout: float = 60.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_connections: int | None = 1024,
    stall_timeout: float = 300.0,
    warmup: Warmup | None = None,
    events: Any = None,
) -> FastAPI:
    """The OpenAI-compatible app. The engine loop starts with the app's lifespan and stops (aborting what
    is left, flushing pending saves) when it ends. `max_waiting`: requests that may wait for a slot before
    new ones get 429 (None: unlimited). `default_max_tokens`: chat completions without max_tokens generate
    up to this many (or what the context leaves). `max_connections`: HTTP requests in progress at once
    (streams included); one more gets 503 (None: unlimited). `stall_timeout`: seconds an engine step may
    run before /health reports the engine stalled. `warmup`: stepped on the engine thread while it has no
    request to serve (`Warmup`); /health answers 200 with status "warming" until it ends, then "ok".
    `events`: an `EventPublisher` (`serve.http.kv_events`) given the prefix store's events after every
    step, closed when the app ends."""
    server = Server(
        engine,
        tokenizer,
        model_name,
        max_waiting=max_waiting,
        default_max_tokens=default_max_tokens,
        max_body_bytes=max_body_bytes,
        stall_timeout=stall_timeout,
        warmup=warmup,
        events=events,
    )
    prefix = engine.config.prefix
    prefix_cache = prefix is not None and prefix.enabled

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        log.info("serving '%s' (context %d tokens)", model_name, engine.max_model_len)
        try:
            yield
        finally:
            log.info("stopping the engine: aborting unfinished requests, flushing the prefix store")
            await asyncio.to_thread(server.loop.stop, stop_timeout)
            if events is not None:
                await asyncio.to_thread(events.close)

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
                    "vocab_size": engine.model_config.vocab_size,
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
        body: dict[str, Any] = {"status": "ok", "model": model_name, "prefix_cache": prefix_cache}
        if prefix_cache:  # what a router weighs (`serve.route.policies`): how many chains the store can keep
            body["checkpoint_capacity"] = engine.checkpoint_capacity()
        progress = server.loop.warmup_progress()
        if progress is not None:
            body["warmup"] = progress.as_json()
            if progress.state is WarmupState.WARMING:
                body["status"] = "warming"  # serving: requests may meet a program not compiled yet
        return JSONResponse(body)

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

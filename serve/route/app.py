"""The router's OpenAI-compatible front: POST /v1/completions and /v1/chat/completions go to the replica the
policy ranks first (`serve.route.policies`), streams passed through as they come; GET /v1/models is the
first healthy replica's; GET /health is 200 while a replica answers; GET /route/stats says, per replica,
whether it is healthy, its requests in flight, how many were routed there, what its index holds (blocks,
checkpoints, chains: `ReplicaIndex.chains`) and its store's checkpoint capacity (from its /health).

Faults: a replica that refuses the connection, fails before its first bytes (a stream's first token, a
whole answer otherwise) or answers 503 is marked down (its index dropped: `Backend.down`) and the request
goes to the next one, so a client sees no error unless every replica fails; one that answers 429 (its queue
is full) passes the request on too. Once the first bytes have gone to the client the response is the
client's (a stream cut by a dying replica ends there). A health check every
`health_interval` seconds re-admits a replica that answers again, and its events are replayed from scratch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.route.backends import Backend, Ticket
from serve.route.policies import Chooser

log = logging.getLogger("jaxhybrid.route")
PASS_ON = (429, 503)  # answers that send the request to the next replica
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def prompt_tokens(body: dict[str, Any], chat: bool, tokenizer: Any) -> list[int]:
    """The prompt's token ids as a replica would see them, or [] when the router cannot tell (then it routes
    on load alone; the replica validates the request)."""
    try:
        if chat:
            messages = [
                {**m, "content": m.get("content") if isinstance(m.get("content"), str) else ""}
                for m in body.get("messages", [])
            ]
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
    except Exception:  # noqa: BLE001 - anything the router cannot tokenize is routed on load
        pass
    return []


def checkpoint_capacity(resp: httpx.Response) -> int | None:
    """The checkpoints a replica's store keeps in memory at most, as its /health says (None: not said)."""
    try:
        value = resp.json().get("checkpoint_capacity")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Router:
    def __init__(self, backends: Sequence[Backend], chooser: Chooser, tokenizer: Any, timeout: float):
        self.backends, self.chooser, self.tokenizer = list(backends), chooser, tokenizer
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))
        self.retried = 0

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        tokens = prompt_tokens(body, chat, self.tokenizer) if self.tokenizer is not None else []
        candidates = self.chooser.rank(tokens)
        if not candidates:
            return error(503, "no replica is available", "service_unavailable")
        headers = {"content-type": "application/json"}
        last: Response | None = None
        for i, cand in enumerate(candidates):
            if i:
                self.retried += 1
            ticket = cand.backend.start(cand.prefill, cand.prefixes, cand.new_chain)
            try:
                req = self.client.build_request("POST", cand.backend.url + path, content=raw, headers=headers)
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                log.warning("backend %s failed before answering (%s): trying the next", cand.backend.url, exc)
                ticket.end()
                cand.backend.down()
                continue
            if resp.status_code in PASS_ON:
                last = Response(await resp.aread(), resp.status_code, media_type="application/json")
                await resp.aclose()
                ticket.end()
                if resp.status_code == 503:
                    cand.backend.down()
                continue
            chunks = resp.aiter_raw()
            try:  # the first bytes (a stream's first token): until then the request may go elsewhere
                first = await anext(chunks, b"")
            except httpx.HTTPError as exc:
                log.warning(
                    "backend %s failed before its first token (%s): trying the next", cand.backend.url, exc
                )
                await resp.aclose()
                ticket.end()
                cand.backend.down()
                continue
            ticket.first_token()
            return self._relay(resp, first, chunks, ticket)
        return last if last is not None else error(503, "every replica failed", "service_unavailable")

    def _relay(
        self, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes], ticket: Ticket
    ) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}

        async def body() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await resp.aclose()
                ticket.end()

        return StreamingResponse(body(), resp.status_code, headers=headers)

    async def check_health(self) -> None:
        for b in self.backends:
            try:
                resp = await self.client.get(b.url + "/health", timeout=2.0)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                b.capacity = checkpoint_capacity(resp)
            if ok and not b.healthy:
                b.up()
                if b.follower is not None:
                    b.follower.resync.set()
            elif not ok and b.healthy:
                b.down()

    def stats(self) -> dict[str, Any]:
        out = []
        for b in self.backends:
            with b.lock:
                blocks, checkpoints, chains = len(b.index), b.index.checkpoints, b.index.chains
            out.append(
                {
                    "url": b.url,
                    "healthy": b.healthy,
                    "in_flight": b.in_flight,
                    "routed": b.routed,
                    "blocks": blocks,
                    "checkpoints": checkpoints,
                    "chains": chains,
                    "checkpoint_capacity": b.capacity,
                    "replays": 0 if b.follower is None else b.follower.replays,
                    "events": None if b.follower is None else dict(b.follower.last),
                }
            )
        return {"policy": self.chooser.policy.value, "retried": self.retried, "backends": out}


def create_router_app(
    backends: Sequence[Backend],
    chooser: Chooser,
    tokenizer: Any,
    *,
    health_interval: float = 1.0,
    timeout: float = 600.0,
) -> FastAPI:
    router = Router(backends, chooser, tokenizer, timeout)

    async def health_loop() -> None:
        while True:
            await router.check_health()
            await asyncio.sleep(health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()
            for b in backends:
                await asyncio.to_thread(b.close)

    app = FastAPI(title="jaxhybrid route", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        for b in backends:
            if b.healthy:
                try:
                    r = await router.client.get(b.url + "/v1/models", timeout=5.0)
                except httpx.HTTPError:
                    continue
                return Response(r.content, r.status_code, media_type="application/json")
        return error(503, "no replica is available", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        up = sum(b.healthy for b in backends)
        body = {"status": "ok" if up else "down", "healthy": up, "backends": len(backends)}
        return JSONResponse(body, 200 if up else 503)

    @app.get("/route/stats")
    async def stats() -> Response:
        return JSONResponse(router.stats())

    return app

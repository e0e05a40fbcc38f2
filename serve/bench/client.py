"""The HTTP side of `jaxhybrid bench serve`: what the server says about itself (/health, /v1/models,
/metrics) and one streamed completion, timed token by token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx

from serve.bench.workload import BenchRequest

PREFIX_SERIES = ("hit_tokens", "lookups", "hits", "recomputed_tokens")  # jaxhybrid_prefix_*_total
SPEC_SERIES = ("windows", "draft_tokens", "accepted_tokens")  # jaxhybrid_spec_decode_*_total


class ServerError(RuntimeError):
    """The server cannot be benchmarked (not reachable, unhealthy, refuses the workload): one line, exit 2."""


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """The served model and what /health reported once the server was ready."""

    model: str
    max_model_len: int | None
    vocab_size: int | None
    prefix_cache: bool | None  # None: the server does not say
    health: dict[str, Any]


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from just before it was sent."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None  # to the first streamed chunk that carries tokens
    e2e_s: float = 0.0  # to the end of the stream
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks carrying tokens
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _unreachable(base_url: str, exc: Exception) -> ServerError:
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return ServerError(f"--base-url {base_url!r} is not an http(s) URL ({exc})")
    return ServerError(
        f"cannot reach a server at {base_url} ({type(exc).__name__}: {exc or 'no answer'}); "
        "is `jaxhybrid serve` running there?"
    )


async def _get_json(client: httpx.AsyncClient, path: str) -> tuple[int, Any]:
    try:
        r = await client.get(path)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _unreachable(str(client.base_url).rstrip("/"), exc) from None
    try:
        return r.status_code, r.json()
    except ValueError:
        raise ServerError(
            f"{client.base_url}{path} did not answer JSON: is this a jaxhybrid server?"
        ) from None


async def probe(client: httpx.AsyncClient, ready_timeout: float, on_wait: Any = None) -> ServerInfo:
    """Wait until /health says "ok" (while it says "warming", up to `ready_timeout` s; 0: do not wait), then
    read the model
    from /v1/models. `on_wait(health)` is called on every poll that found the server warming."""
    deadline = time.monotonic() + ready_timeout
    while True:
        status, health = await _get_json(client, "/health")
        if status != 200:
            message = health.get("error", {}).get("message") if isinstance(health, dict) else None
            raise ServerError(f"the server is not healthy (HTTP {status}): {message or health}")
        if not isinstance(health, dict) or health.get("status") != "warming" or ready_timeout == 0:
            break
        if time.monotonic() > deadline:
            raise ServerError(
                f"the server was still warming up after {ready_timeout:.0f} s (--ready-timeout)"
            )
        if on_wait is not None:
            on_wait(health)
        await asyncio.sleep(0.5)
    status, models = await _get_json(client, "/v1/models")
    try:
        entry = models["data"][0]
        name = entry["id"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{client.base_url}/v1/models lists no model (HTTP {status})") from None
    prefix = health.get("prefix_cache") if isinstance(health, dict) else None
    return ServerInfo(name, entry.get("max_model_len"), entry.get("vocab_size"), prefix, health)


async def server_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefix-store counters from /metrics (`jaxhybrid_prefix_{name}_total`, keyed `name`) and
    its speculative decoding counters (`jaxhybrid_spec_decode_{name}_total`, keyed `spec_{name}`); the ones
    it does not keep (prefix cache off) are missing; {} when /metrics does not answer."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    series = {f"jaxhybrid_prefix_{name}_total": name for name in PREFIX_SERIES}
    series |= {f"jaxhybrid_spec_decode_{name}_total": f"spec_{name}" for name in SPEC_SERIES}
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in series:
            out[series[name]] = float(value)
    return out


def completion_body(model: str, req: BenchRequest, temperature: float, cache_salt: str | None) -> dict:
    """A streamed /v1/completions request that generates exactly `max_tokens` (ignore_eos) and reports its
    token ids and usage."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def _error_message(status: int, raw: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(raw)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"


async def stream_completion(client: httpx.AsyncClient, body: dict) -> RequestResult:
    """Send one streamed completion; time its first token, the gaps between token chunks and its end."""
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = _error_message(r.status_code, await r.aread())
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message", event["error"]))
                    continue
                ids = sum((len(c.get("token_ids") or []) for c in event.get("choices", [])), 0)
                if ids:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.output_tokens += ids
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            else:
                res.error = res.error or "the stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.ok, res.error = False, f"{type(exc).__name__}: {exc}"
    res.e2e_s = time.perf_counter() - t0
    return res

"""A seeded storm of malformed and hostile HTTP requests against the OpenAI-compatible endpoints, and a
runner that sends them from several threads and counts what came back (shared by the hostile-input tests).

Each request is raw bytes (so invalid JSON, invalid UTF-8 and lone surrogates reach the server as a
client would send them). The mix: broken and deeply nested JSON, random bytes, wrong types, huge and
non-finite numbers, integers past the float range and of thousands of digits, lone surrogates in every
string field and in field names, unknown fields, oversized salts and stop strings, chunked uploads, and a
share of valid requests (streamed or not) so the engine is busy while the rest arrives.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from collections import Counter
from collections.abc import Iterator

import httpx

from serve.http.parsing import CHAT_FIELDS, COMPLETION_FIELDS

PATHS = ("/v1/completions", "/v1/chat/completions")
SURROGATES = ("\ud800", "\udfff", "a\udc80b", "\ud83d")
FIELDS = tuple(sorted(COMPLETION_FIELDS | CHAT_FIELDS))  # every field the endpoints know


@dataclasses.dataclass
class Hostile:
    path: str
    body: bytes
    kind: str  # which family generated it
    chunked: bool = False  # sent with Transfer-Encoding: chunked (no Content-Length)
    stream_reply: bool = False  # read the answer as a stream


def _raw(obj: object) -> bytes:
    """JSON with lone surrogates kept as \\uXXXX escapes (valid JSON text a client can send)."""
    return json.dumps(obj, ensure_ascii=True).encode()


def _weird_value(rng: random.Random) -> object:
    choices = [
        None,
        True,
        -1,
        0,
        2**63,
        -(2**70),
        1.5,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        "",
        "x" * rng.choice([1, 300, 5000]),
        rng.choice(SURROGATES),
        [],
        [1, "a", None],
        {},
        {"a": {"b": [1]}},
        [[1, 2], [3]],
        list(range(200)),
    ]
    return rng.choice(choices)


def _valid(rng: random.Random, path: str) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 4), "temperature": 0, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "hello there", "abc"])}]
    else:
        body["prompt"] = rng.choice(["Hello", "def f(", [5, 6, 7], "x y z"])
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.2:
        body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
    if rng.random() < 0.2:
        body["speculative"] = rng.choice(["ngram", "off", {"method": "ngram", "num_speculative_tokens": 2}])
    return body


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def one(rng: random.Random) -> Hostile:
    path = rng.choice(PATHS)
    kind = rng.choice(
        (
            "valid",
            "valid",
            "broken_json",
            "nested",
            "random_bytes",
            "wrong_type",
            "huge_number",
            "surrogate",
            "unknown_field",
            "oversized",
            "chunked",
            "not_object",
        )
    )
    base = _valid(rng, path)
    if kind == "valid":
        return Hostile(path, _raw(base), kind, stream_reply=bool(base.get("stream")))
    if kind == "broken_json":
        text = _raw(base).decode()
        cut = text[: rng.randint(0, len(text) - 1)]
        noise = rng.choice(["", "}", "{{", ",,", '"', "\\", "\x00", "nul", "[1,]"])
        return Hostile(path, (cut + noise).encode(), kind)
    if kind == "nested":
        depth = rng.choice([50, 900, 1100, 5000, 100_000])
        field = rng.choice(["prompt", "metadata", "stop", "logit_bias", "bogus", "messages"])
        if field in ("metadata", "logit_bias"):
            inner = '{"a": ' * depth + "1" + "}" * depth
        else:
            inner = _nested(depth)
        body = _raw(base)[:-1] + f', "{field}": {inner}}}'.encode()
        if rng.random() < 0.3:
            body = _nested(depth).encode()
        return Hostile(path, body, kind)
    if kind == "random_bytes":
        return Hostile(path, bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400))), kind)
    if kind == "wrong_type":
        for _ in range(rng.randint(1, 3)):
            base[rng.choice(FIELDS)] = _weird_value(rng)
        return Hostile(path, _raw(base), kind, stream_reply=base.get("stream") is True)
    if kind == "huge_number":
        field = rng.choice(
            ["max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "n", "presence_penalty"]
        )
        number = rng.choice(
            ["1e400", "-1e400", "9" * 5000, "-" + "9" * 4400, "1" + "0" * 4300, "NaN"]
            + ["1" + "0" * 400, "-" + "9" * 310, "9" * 4299]  # decodes, but float() overflows
        )
        text = _raw(base).decode()[:-1] + f', "{field}": {number}}}'
        if rng.random() < 0.3:
            text = _raw(base).decode()[:-1] + f', "prompt": [1, {"9" * 5000}]}}'
        return Hostile(path, text.encode(), kind)
    if kind == "surrogate":
        s = rng.choice(SURROGATES)
        where = rng.choice(["cache_salt", "model", "field_name", "prompt", "stop", "content", "role", "user"])
        if where == "field_name":
            base[s + "x"] = 1
        elif where == "content" and "messages" in base:
            base["messages"][0]["content"] = "hi " + s
        elif where == "role" and "messages" in base:
            base["messages"][0]["role"] = s
        elif where == "prompt" and "prompt" in base:
            base["prompt"] = "hi " + s
        else:
            base[where if where not in ("content", "role", "prompt") else "cache_salt"] = s
        return Hostile(path, _raw(base), kind, stream_reply=bool(base.get("stream")))
    if kind == "unknown_field":
        base[rng.choice(["foo", "tools", "functions", "response_format", "x" * 300, ""])] = _weird_value(rng)
        return Hostile(path, _raw(base), kind)
    if kind == "oversized":
        field = rng.choice(["cache_salt", "stop", "user", "prompt", "stop_many"])
        if field == "stop_many":
            base["stop"] = ["ab"] * rng.choice([17, 1000])
        elif field == "stop":
            base["stop"] = ["z" * rng.choice([2000, 100_000])]
        elif field == "prompt" and "prompt" in base:
            base["prompt"] = "w " * 100_000
        else:
            base["cache_salt" if field == "prompt" else field] = "s" * rng.choice([257, 1 << 20])
        return Hostile(path, _raw(base), kind)
    if kind == "chunked":
        big = rng.random() < 0.3
        body = _raw({**base, "user": "u" * (17 << 20)}) if big else _raw(base)
        return Hostile(path, body, kind, chunked=True)
    # not_object
    return Hostile(path, _raw(rng.choice([[base], "text", 5, None, [], True])), kind)


def storm(seed: int, n: int) -> list[Hostile]:
    rng = random.Random(seed)
    return [one(rng) for _ in range(n)]


@dataclasses.dataclass
class StormResult:
    statuses: Counter
    dropped: list[str]  # requests answered with no HTTP response (connection reset, closed, timed out)
    bad_bodies: list[str]  # 4xx/5xx answers that are not OpenAI-shaped JSON errors

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def _chunks(body: bytes) -> Iterator[bytes]:
    for i in range(0, len(body), 1 << 16):
        yield body[i : i + (1 << 16)]


def send(url: str, requests: list[Hostile], concurrency: int = 16, timeout: float = 60.0) -> StormResult:
    """Send every request, `concurrency` at a time, each on a client of its thread."""
    statuses: Counter = Counter()
    dropped: list[str] = []
    bad: list[str] = []
    lock = threading.Lock()
    todo = list(enumerate(requests))

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=timeout) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    i, h = todo.pop()
                headers = {"content-type": "application/json"}
                content = _chunks(h.body) if h.chunked else h.body
                try:
                    with client.stream("POST", h.path, content=content, headers=headers) as r:
                        data = r.read()
                        status = r.status_code
                except httpx.HTTPError as exc:
                    with lock:
                        dropped.append(f"#{i} {h.kind}: {type(exc).__name__}: {exc}")
                    continue
                problem = None
                if status >= 400:
                    try:
                        err = json.loads(data)["error"]
                        if set(err) != {"message", "type", "param", "code"}:
                            problem = "error fields"
                    except Exception:  # noqa: BLE001
                        problem = "not JSON"
                with lock:
                    statuses[status] += 1
                    if problem:
                        bad.append(f"#{i} {h.kind} {status} {problem}: {data[:200]!r}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return StormResult(statuses, dropped, bad)

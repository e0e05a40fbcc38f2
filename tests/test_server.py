"""The OpenAI-compatible server: endpoints, streaming, errors, queue limit, disconnects, metrics, and the
`jaxhybrid serve` command as a subprocess.

One uvicorn server (tiny model, 2 slots, context 64 in one 64-token block, so few programs compile) runs in
a thread for the whole module; tests that need a busy engine slow its step down.
"""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from faults import lose_pools_on_continued_prefill
from flax import nnx
from oracles import FullPass, assert_same_greedy_tokens, logprob_bounds
from servers import free_port, uvicorn_thread

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.engine.engine import Engine, EngineConfig
from serve.http.app import create_app

SLOTS = 2
CONTEXT = 64


class Served:
    def __init__(self, app, engine, url):
        self.app, self.engine, self.url = app, engine, url
        self.server = app.state.server
        self.client = httpx.Client(base_url=url, timeout=60)

    def engine_state(self) -> dict:
        def take(e):
            return {
                "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting),
                "free_slots": len(e.scheduler.free_slots),
                "used_blocks": e.allocator.num_used,
                "store_blocks": len(set(e.store.held_blocks)) if e.store is not None else 0,
                "live_kv_bytes": e.ledger().live_kv_bytes,
                "live_requests": len(e.memory().requests),
                "steps": e.steps,
                "requests": len(e.requests),
            }

        return self.server.loop.call(take).result(timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            st = self.engine_state()
            if st["running"] == 0 and st["waiting"] == 0:
                return st
            assert time.monotonic() < deadline, f"engine still busy: {st}"
            time.sleep(0.05)

    @contextlib.contextmanager
    def slow_steps(self, delay: float):
        """Make every engine step take at least `delay` seconds (to keep requests running)."""
        engine = self.engine
        original = engine.step

        def slow():
            time.sleep(delay)
            return original()

        engine.step = slow
        try:
            yield
        finally:
            engine.step = original


@pytest.fixture(scope="module")
def served():
    model = HybridLM(load_config("tiny"), rngs=nnx.Rngs(0))
    engine = Engine(
        model, EngineConfig(max_slots=SLOTS, block_size=64, prefill_chunk=16, max_model_len=CONTEXT)
    )
    app = create_app(engine, ByteTokenizer(512), "tiny", max_waiting=1, default_max_tokens=8)
    with uvicorn_thread(app) as url:
        s = Served(app, engine, url)
        yield s
        s.client.close()


def complete(s: Served, **body) -> dict:
    r = s.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(lines) -> list:
    """The JSON payloads of an SSE stream, then the literal [DONE]."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream(s: Served, path: str, **body) -> list:
    with s.client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]" and all(e != "[DONE]" for e in events[:-1])
    return events[:-1]


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_completion_text_and_token_ids(served):
    out = complete(served, model="tiny", prompt="Hello", max_tokens=6, return_token_ids=True, **GREEDY)
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 6, 11)
    assert "cached_tokens" in usage["prompt_tokens_details"]
    ids = ByteTokenizer().encode("Hello")
    same = complete(served, prompt=ids, max_tokens=6, return_token_ids=True, **GREEDY)
    assert same["choices"][0]["token_ids"] == choice["token_ids"]  # text and token-id prompts agree
    assert same["choices"][0]["text"] == choice["text"]
    # a longer prompt reuses the first one through its prompt-end checkpoint
    longer = complete(served, prompt=ids + ByteTokenizer().encode(", world"), max_tokens=2, **GREEDY)
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids)


def test_stream_equals_blocking_greedy(served):
    body = {"prompt": "The sky", "max_tokens": 12, "logprobs": 1, "return_token_ids": True, **GREEDY}
    full = complete(served, **body)["choices"][0]
    chunks = stream(served, "/v1/completions", **body, stream_options={"include_usage": True})
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    chunks = chunks[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    lps = [
        x
        for c in chunks
        if c["choices"][0]["logprobs"]
        for x in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    # the second run may resume from the first's prompt-end checkpoint (other fp32 orders): the same tokens up
    # to a near-tie of the full pass, logprobs within two fp32 evaluations' bound (tests/oracles.py)
    oracle = FullPass(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)))  # the served model: same seed
    prompt = ByteTokenizer(512).encode("The sky")
    assert_same_greedy_tokens(oracle, prompt, ids, full["token_ids"])
    if ids == full["token_ids"]:
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
        seq = prompt + ids
        _, tol = logprob_bounds(oracle.model.config, oracle(seq[:-1])[len(prompt) - 1 :], ids, len(seq))
        assert np.all(np.abs(np.subtract(lps, full["logprobs"]["token_logprobs"])) <= tol)

    messages = [{"role": "user", "content": "hi"}]
    chat = served.client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 10, "return_token_ids": True, **GREEDY},
    ).json()
    assert chat["object"] == "chat.completion"
    msg = chat["choices"][0]["message"]
    assert msg["role"] == "assistant" and chat["usage"]["completion_tokens"] == 10
    events = stream(
        served, "/v1/chat/completions", messages=messages, max_tokens=10, return_token_ids=True, **GREEDY
    )
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == msg["content"]
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == chat["choices"][0][
        "token_ids"
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_prefix_reuse_and_cache_salt(served):
    turn1 = [{"role": "user", "content": "q"}]
    first = served.client.post(
        "/v1/chat/completions", json={"messages": turn1, "max_tokens": 2, "cache_salt": "tenant-a", **GREEDY}
    ).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = [*turn1, first["choices"][0]["message"], {"role": "user", "content": "m"}]
    body = {"messages": turn2, "max_tokens": 2, **GREEDY}
    again = served.client.post("/v1/chat/completions", json={**body, "cache_salt": "tenant-a"}).json()
    other = served.client.post("/v1/chat/completions", json={**body, "cache_salt": "tenant-b"}).json()
    assert "usage" in again, again
    # the second turn resumes from the first turn's prompt (at least); another tenant reuses nothing
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"] == other["choices"][0]["message"]


def test_stop_strings_and_stop_token_ids(served):
    base = complete(served, prompt="stop test", max_tokens=24, return_token_ids=True, **GREEDY)["choices"][0]
    ids, text = base["token_ids"], base["text"]
    # a stop token id: generation ends at its first occurrence (counted, not shown)
    k = ids.index(ids[3])
    out = complete(served, prompt="stop test", max_tokens=24, stop=[ids[3]], return_token_ids=True, **GREEDY)
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["token_ids"] == ids[: k + 1]
    # a stop string: the text is cut before it, streamed or not
    i = next(i for i in range(1, len(text)) if text[i] not in text[:i])
    body = {"prompt": "stop test", "max_tokens": 24, "stop": [text[i], "never-seen"], **GREEDY}
    out = complete(served, **body)["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == text[:i]
    chunks = stream(served, "/v1/completions", **body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:i]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    served.wait_idle()  # the request was aborted once its stop string appeared


TOO_LONG = list(range(3, 3 + CONTEXT))


@pytest.mark.parametrize(
    "method, path, body, status, param",
    [
        ("POST", "/v1/completions", b"{not json", 400, None),
        ("POST", "/v1/completions", [1, 2], 400, None),
        ("POST", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
        ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
        ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 400, "model"),
        ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("POST", "/v1/completions", {"prompt": "x", "top_k": 100000}, 400, "top_k"),
        ("POST", "/v1/completions", {"prompt": "x", "seed": 2**32}, 400, "seed"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("POST", "/v1/completions", {"prompt": "x", "stop": [{"a": 1}]}, 400, "stop"),
        ("POST", "/v1/completions", {"prompt": "x", "stop": [10**6]}, 400, "stop"),
        ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
        ("POST", "/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "logprobs"),
        ("POST", "/v1/completions", {"prompt": "x", "cache_salt": 7}, 400, "cache_salt"),
        ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("POST", "/v1/completions", {"prompt": [1, 100000]}, 400, "prompt"),
        ("POST", "/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            400,
            "messages[0].content",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * CONTEXT}]},
            400,
            "messages",
        ),
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**15}, 400, "max_tokens"),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ("POST", "/v1/completions", {"prompt": "x", "top_p": -0.5}, 400, "top_p"),
        ("POST", "/v1/completions", {"prompt": "x", "presence_penalty": "high"}, 400, "presence_penalty"),
        ("POST", "/v1/completions", {"prompt": "x" * (17 * 2**20)}, 413, None),  # oversized body
        ("GET", "/v1/nothing-here", None, 404, None),
        ("GET", "/v1/completions", None, 405, None),
    ],
)
def test_errors_are_openai_shaped(served, method, path, body, status, param):
    if isinstance(body, bytes):
        r = served.client.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = served.client.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert "Traceback" not in r.text and 'File "' not in r.text
    if param in ("prompt", "max_tokens", "messages") and "context" in err["message"]:
        assert err["code"] == "context_length_exceeded"
    if param == "model":
        assert err["code"] == "model_not_found"
    # the same errors streamed: answered before the stream starts
    if method == "POST" and isinstance(body, dict) and param != "stream":
        r = served.client.post(path, json={**body, "stream": True})
        assert r.status_code == status and "error" in r.json()


def test_queue_full_gives_429(served):
    body = {"prompt": "busy", "max_tokens": 40, "stream": True, **GREEDY}
    with served.slow_steps(0.05), contextlib.ExitStack() as stack:
        streams = []
        for _ in range(SLOTS + 1):  # two hold the slots, one waits (max_waiting=1)
            r = stack.enter_context(served.client.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200
            streams.append(r)
        over = served.client.post("/v1/completions", json={**body, "stream": False})
        assert over.status_code == 429, over.text
        err = over.json()["error"]
        assert (
            err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "Traceback" not in over.text
        )
        over = served.client.post("/v1/completions", json=body)
        assert over.status_code == 429
    st = served.wait_idle()
    assert st["free_slots"] == SLOTS
    # with room again, requests are accepted
    assert complete(served, prompt="busy", max_tokens=2, **GREEDY)["usage"]["completion_tokens"] == 2


def test_client_disconnect_frees_slot_and_blocks(served):
    # A request alone in the engine gains one token a step: one that ran to its 45 tokens would take 45 more
    # steps; a client that goes away must stop it before that (counted in engine steps, not seconds)
    body = {"prompt": "a long answer", "max_tokens": 45, "stream": True, "return_token_ids": True, **GREEDY}
    with served.slow_steps(0.1):
        with served.client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept referenced: a collected line iterator closes the connection
            got = 0
            for line in lines:
                got += line.startswith("data: {")
                if got >= 3:
                    break
            mid = served.engine_state()
            assert mid["running"] == 1 and mid["free_slots"] == SLOTS - 1 and mid["live_kv_bytes"] > 0
        # the stream is closed mid-way
        st = served.wait_idle(timeout=30)
        assert st["steps"] - mid["steps"] < 45 - got
        assert st["free_slots"] == SLOTS and st["live_requests"] == 0 and st["live_kv_bytes"] == 0
        # a non-streamed request whose client gives up waiting (its prefill and first token: one step)
        before = st["steps"]
        with pytest.raises(httpx.ReadTimeout):
            served.client.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
        st = served.wait_idle(timeout=30)
        assert st["steps"] - before < 45
    assert st["free_slots"] == SLOTS and st["live_requests"] == 0 and st["live_kv_bytes"] == 0
    assert st["used_blocks"] == st["store_blocks"]  # only the blocks the prefix store keeps cached
    assert st["requests"] == 0  # finished requests are dropped from the engine's table
    steps = served.engine_state()["steps"]
    time.sleep(0.2)
    assert served.engine_state()["steps"] == steps  # nothing is generated for the lost clients
    metrics = served.client.get("/metrics").text
    assert 'jaxhybrid_requests_total{endpoint="/v1/completions",status="499"}' in metrics


def test_abort_all_ends_streams_cleanly(served):
    """What a graceful shutdown does once its grace period is over: running streams end properly."""
    body = {"prompt": "cut short", "max_tokens": 45, "stream": True, "return_token_ids": True, **GREEDY}
    with served.slow_steps(0.05), served.client.stream("POST", "/v1/completions", json=body) as r:
        events, n = [], 0
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if line.startswith("data: {"):
                n += len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                if n == 2:
                    served.server.loop.abort_all()
    payloads = sse(events)
    assert payloads[-1] == "[DONE]" and payloads[-2]["choices"][0]["finish_reason"] == "abort"
    assert n < 45
    assert served.wait_idle()["free_slots"] == SLOTS


def test_concurrent_requests_all_complete(served):
    results = {}

    def run(i):
        if i % 2:
            events = stream(served, "/v1/completions", prompt="same prompt", max_tokens=5, **GREEDY)
            results[i] = "".join(e["choices"][0]["text"] for e in events)
        else:
            results[i] = complete(served, prompt="same prompt", max_tokens=5, **GREEDY)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    loop = served.server.loop
    loop.max_waiting = None  # 6 requests on 2 slots: let them all queue
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        loop.max_waiting = 1
    assert sorted(results) == list(range(6))
    assert len(set(results.values())) == 1  # greedy: every request gives the same text, batched or not
    served.wait_idle()


def test_models_health_metrics(served):
    models = served.client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert served.client.get("/health").json()["status"] == "ok"
    complete(served, prompt="metrics", max_tokens=3, **GREEDY)
    complete(served, prompt="metrics", max_tokens=3, **GREEDY)  # a prefix hit
    assert served.client.post("/v1/completions", json={"prompt": 5}).status_code == 400
    r = served.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for series in (
        'jaxhybrid_requests_total{endpoint="/v1/completions",status="200"}',
        'jaxhybrid_requests_total{endpoint="/v1/completions",status="400"}',
        "jaxhybrid_request_latency_seconds_bucket",
        "jaxhybrid_time_to_first_token_seconds_bucket",
        "jaxhybrid_request_tokens_per_second_bucket",
        "jaxhybrid_generation_tokens_per_second",
        "jaxhybrid_generation_tokens_total",
        "jaxhybrid_prompt_tokens_total",
        "jaxhybrid_requests_running",
        "jaxhybrid_requests_waiting",
        "jaxhybrid_prefix_hits_total",
        "jaxhybrid_prefix_hit_tokens_total",
        "jaxhybrid_prefix_recomputed_tokens_total",
        'jaxhybrid_ledger_bytes{kind="checkpoint",tier="device"}',
        'jaxhybrid_ledger_bytes{kind="checkpoint",tier="host"}',
        'jaxhybrid_ledger_bytes{kind="live_kv",tier="device"}',
        'jaxhybrid_checkpoint_bytes{kind="prompt_end",tier="device"}',
        'jaxhybrid_checkpoint_bytes{kind="sequence_end",tier="disk"}',
        'jaxhybrid_checkpoints_by_kind{kind="interval",tier="host"}',
        'jaxhybrid_kv_pool_bytes{state="used"}',
    ):
        assert series in text, series
    hits = next(line for line in text.splitlines() if line.startswith("jaxhybrid_prefix_hit_tokens_total"))
    assert float(hits.split()[-1]) > 0
    value = lambda series: float(next(x for x in text.splitlines() if x.startswith(series + " ")).split()[-1])
    assert (
        value('jaxhybrid_checkpoints_by_kind{kind="prompt_end",tier="device"}') >= 1
    )  # "metrics" ends there


def test_speculative_field(served):
    """A request that drafts (prompt lookup) gets the tokens it gets without; a bad `speculative` is a 400
    naming the field; /metrics counts what was drafted and accepted."""
    body = dict(prompt="abcabcabcabcabcabc", max_tokens=8, return_token_ids=True, **GREEDY)
    plain = complete(served, **body)["choices"][0]["token_ids"]
    for spec in ("ngram", {"method": "ngram", "num_speculative_tokens": 2}, "off"):
        assert complete(served, speculative=spec, **body)["choices"][0]["token_ids"] == plain
    limit = served.engine.config.speculative.num_tokens
    for bad in (
        "medusa",
        5,
        ["ngram"],
        {"num_speculative_tokens": 2},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": limit + 1},
        {"method": "ngram", "num_speculative_tokens": 2.5},
        {"method": "ngram", "k": 2},
        "draft",  # this server has no draft model
    ):
        r = served.client.post("/v1/completions", json={**body, "speculative": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", (bad, r.text)
    text = served.client.get("/metrics").text
    for series in (
        "jaxhybrid_spec_decode_windows_total",
        "jaxhybrid_spec_decode_draft_tokens_total",
        "jaxhybrid_spec_decode_accepted_tokens_total",
        "jaxhybrid_spec_decode_mean_accepted_tokens",
    ):
        assert series in text, series


def test_serve_help_and_flag_errors(capsys):
    from serve.cli import build_parser, main

    sub = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = sub.format_help()
    for flag in (
        "--host",
        "--port",
        "--model",
        "--config",
        "--mesh",
        "--slots",
        "--block-size",
        "--kv-memory-mb",
        "--checkpoint-interval",
        "--no-prompt-end-checkpoints",
        "--store-dir",
        "--max-waiting",
        "--shutdown-timeout",
    ):
        assert flag in help_text, flag
    assert main(["serve", "--mesh", "data=3"]) == 2
    assert "needs 3 devices" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2


def test_jaxhybrid_serve_with_no_arguments():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.TransportError):
                health = httpx.get(f"{url}/health", timeout=2)
                if health.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.25)
        assert health.json()["status"] == "warming"  # compiling in the background, and serving meanwhile
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "stdlib-small"  # the shipped model
        assert r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "embedded default" in out and "shipped model" in out
        assert (
            "warm-up (--warmup all)" in out and "warm-up stopped at shutdown" in out
        )  # SIGTERM while warming
        assert "Traceback" not in out
        assert "compilation cache: " in out  # on by default, in the session's own cache dir (conftest)
        # quiet by default: our own few lines (and one per warm-up program), no library INFO chatter
        lines = [line for line in out.splitlines() if line.strip()]
        assert all(" INFO " not in line or " jaxhybrid." in line for line in lines), out
        ours = [line for line in lines if not re.search(r"warm-up \d+/\d+: ", line)]
        # (one of them may say that the first request waited for its program, and how long)
        assert len(ours) <= 8, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_official_openai_client(served):
    """The unchanged `openai` client gets completions and chat completions, streamed and not."""
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, extra_body=extra)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(
            model="tiny", prompt="Hi", max_tokens=4, temperature=0, stream=True, extra_body=extra
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    parts = list(
        client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=4, temperature=0, stream=True, extra_body=extra
        )
    )
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    served.wait_idle()


def test_64_concurrent_streams_equal_requests_served_alone(served):
    prompts = [f"prompt number {i % 8}" for i in range(64)]
    alone = {
        p: complete(served, prompt=p, max_tokens=4, **GREEDY)["choices"][0]["text"] for p in set(prompts)
    }
    results: dict[int, str] = {}

    def run(i):
        events = stream(served, "/v1/completions", prompt=prompts[i], max_tokens=4, **GREEDY)
        results[i] = "".join(e["choices"][0]["text"] for e in events)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    loop = served.server.loop
    loop.max_waiting = None
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        loop.max_waiting = 1
    assert len(results) == 64
    assert all(results[i] == alone[prompts[i]] for i in range(64))
    served.wait_idle()


def test_identical_chat_request_reports_cached_tokens(served):
    body = {"messages": [{"role": "user", "content": "the same question"}], "max_tokens": 2, **GREEDY}
    first = served.client.post("/v1/chat/completions", json=body).json()
    again = served.client.post("/v1/chat/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    metrics = served.client.get("/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("jaxhybrid_prefix_hit_tokens")]
    assert hits and float(hits[0].split()[-1]) >= first["usage"]["prompt_tokens"]
    served.wait_idle()


def test_ignored_openai_fields_are_accepted_and_the_server_keeps_serving(served):
    want = complete(served, prompt="steady", max_tokens=4, **GREEDY)["choices"][0]["text"]
    extra = {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.1,
        "logit_bias": {"5": 1},
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
    }
    assert complete(served, prompt="steady", max_tokens=4, **GREEDY, **extra)["choices"][0]["text"] == want
    served.wait_idle()


def failed_step_round(served: Served, submitted: threading.Semaphore, a_streams: bool) -> dict:
    """Send A (2 tokens; streamed or not) then B (40 tokens, chunks of 16; the other kind) so that both
    join one step; each one's answer (or the exception its client raised) by name."""
    served.wait_idle(timeout=60)  # both get a slot at once
    ids = random.Random(uuid.uuid4().int).sample(range(300, 512), 47)  # ids no text prompt uses: no hit
    a = {"prompt": ids[:7], "max_tokens": 2, "return_token_ids": True, **GREEDY}
    b = {"prompt": ids[7:], "max_tokens": 2, **GREEDY}  # 40 tokens: chunks of 16
    got: dict = {}

    def send_a():
        if a_streams:
            events = stream(served, "/v1/completions", **a)
            ids = [t for e in events for t in e["choices"][0].get("token_ids", [])]
            got["a"] = (ids, events[-1]["choices"][0])
        else:
            choice = served.client.post("/v1/completions", json=a, timeout=120).json()["choices"][0]
            got["a"] = (choice["token_ids"], choice)

    def send_b():
        if a_streams:
            got["b"] = served.client.post("/v1/completions", json=b, timeout=120).status_code
        else:
            body = {**b, "stream": True}
            with served.client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
                got["b"] = sse(r.iter_lines())

    def catching(f):
        try:
            f()
        except Exception as exc:  # noqa: BLE001 - reported by the caller's asserts
            got[f.__name__] = exc

    gate = threading.Event()
    held = served.server.loop.call(lambda e: gate.wait(30))  # both join the engine's next step
    threads = [threading.Thread(target=catching, args=(f,)) for f in (send_a, send_b)]
    for t in threads:  # A first: its whole prompt fits the step's token budget
        t.start()
        assert submitted.acquire(timeout=30)
    gate.set()
    held.result(30)
    for t in threads:
        t.join(150)
    return got


def test_a_request_finished_in_a_failed_step_gets_its_answer_blocking_and_streamed(served, monkeypatch):
    """Issue 27.1: A decodes its last token in the step whose later prefill call (B's second chunk) fails
    after donating the pools. A's client still gets its whole answer (blocking, then streamed) instead of
    waiting forever; B's gets the error; the server goes on."""
    engine, loop = served.engine, served.server.loop
    exercised = []

    def check_a_finished_here():  # in B's second chunk: A decoded its last token earlier in this step
        state = [(len(r.prompt), str(r.status), len(r.generated)) for r in engine.requests.values()]
        exercised.append((any(r.finished and len(r.generated) == 2 for r in engine.requests.values()), state))

    lose_pools_on_continued_prefill(monkeypatch, engine.runner, check_a_finished_here)
    submitted = threading.Semaphore(0)
    submit = loop.submit

    def counted(*args):
        fut = submit(*args)
        submitted.release()
        return fut

    monkeypatch.setattr(loop, "submit", counted)
    for a_streams in (False, True):
        # A and B join one step unless the engine thread, loaded, admits them a step apart; then A finishes
        # before B's failing chunk and the round is repeated (every round's answers are still checked).
        for _ in range(3):
            got = failed_step_round(served, submitted, a_streams)
            assert "a" in got and "b" in got, got
            tokens, last = got["a"]
            assert len(tokens) == 2 and last["finish_reason"] == "length"
            if a_streams:
                assert got["b"] == 500
            else:
                assert got["b"][-1] == "[DONE]" and got["b"][-2]["error"]["type"] == "server_error"
            if exercised and exercised[-1][0]:
                break
        assert exercised and exercised[-1][0], f"A did not finish in the failed step: {exercised}"
    assert loop.health() is None
    assert served.wait_idle()["free_slots"] == SLOTS

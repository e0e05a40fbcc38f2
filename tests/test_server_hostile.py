"""No request can stop the server: a seeded storm of hostile requests against a live uvicorn server (tiny
model, prefix store on), then the same greedy text as before; and generated bodies against the parser
and the app (Hypothesis): every answer is 2xx or a 4xx in the OpenAI error shape."""

import threading
import time

import hostile
import httpx
import pytest
import uvicorn
from flax import nnx
from test_server import free_port

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.engine import Engine, EngineConfig
from serve.server import create_app

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live():
    model = HybridLM(load_config("tiny"), rngs=nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=64))
    app = create_app(engine, ByteTokenizer(512), "tiny", max_waiting=None, default_max_tokens=4)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(30)


def reference_texts(url: str) -> list[str]:
    with httpx.Client(base_url=url, timeout=60) as c:
        out = []
        for body in (
            {"prompt": "Hello", "max_tokens": 8, **GREEDY},
            {"prompt": "Hello", "max_tokens": 8, "cache_salt": "t", **GREEDY},
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **GREEDY},
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append(choice.get("text") or choice["message"]["content"])
        assert c.get("/health").status_code == 200
        return out


def test_hostile_storm_gives_no_5xx_no_dropped_connection_and_the_engine_lives(live):
    url, _ = live
    before = reference_texts(url)
    result = hostile.send(url, hostile.storm(seed=15, n=1000), concurrency=16)
    assert result.dropped == []
    assert result.server_errors == 0, result.statuses
    assert result.bad_bodies == []
    assert sum(result.statuses.values()) == 1000
    assert reference_texts(url) == before

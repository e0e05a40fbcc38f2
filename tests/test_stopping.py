"""When generation stops and what text a client sees: EOS through the engine and through
/v1/chat/completions, seeded sampling over HTTP, and the text tracker's stop strings over token and
UTF-8 boundaries. Oracles: a greedy run with ignore_eos (where EOS first appears), and texts cut by hand."""

import dataclasses
import json

import jax.numpy as jnp
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.http.app import Event, Tracker, create_app

TOK = ByteTokenizer(512)
CHAT = [{"role": "user", "content": "hi"}]


def make_engine(model):
    return Engine(model, EngineConfig(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=128))


@pytest.fixture(scope="module")
def greedy_run():
    """tiny's greedy continuation of the chat prompt with EOS ignored, and a token to call EOS: the first
    generated token that does not also occur earlier (so the stop position is unambiguous)."""
    cfg = load_config("tiny")
    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    prompt = TOK.apply_chat_template(CHAT, add_generation_prompt=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = make_engine(model).generate([prompt], params)[0].token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    eos_cfg = dataclasses.replace(cfg, eos_token_id=tokens[at])
    eos_model = HybridLM(eos_cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)  # same seed: the same weights
    return prompt, tokens, at, eos_model


def test_eos_stops_the_engine(greedy_run):
    prompt, tokens, at, eos_model = greedy_run
    out = make_engine(eos_model).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: at + 1]  # the EOS token is generated, then nothing more
    ignored = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert make_engine(eos_model).generate([prompt], ignored)[0].token_ids == tokens


def test_eos_stops_a_chat_completion_and_is_not_shown(greedy_run):
    prompt, tokens, at, eos_model = greedy_run
    app = create_app(make_engine(eos_model), TOK, "tiny", default_max_tokens=24)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == TOK.decode(tokens[:at])
        assert body["usage"]["completion_tokens"] == at + 1
        with client.stream(
            "POST", "/v1/chat/completions", json={"messages": CHAT, "temperature": 0, "stream": True}
        ) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:])["choices"][0] for line in lines]
        assert "".join(c["delta"].get("content", "") for c in chunks) == TOK.decode(tokens[:at])
        assert chunks[-1]["finish_reason"] == "stop"


def test_seeded_sampling_over_http_repeats_and_seeds_differ(greedy_run):
    _, _, _, model = greedy_run
    app = create_app(make_engine(model), TOK, "tiny")
    body = {
        "prompt": "Hello",
        "max_tokens": 12,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with TestClient(app) as client:

        def ids(seed, stream=False):
            if not stream:
                r = client.post("/v1/completions", json={**body, "seed": seed})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            with client.stream("POST", "/v1/completions", json={**body, "seed": seed, "stream": True}) as s:
                chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
            return [t for c in chunks for t in c["choices"][0].get("token_ids", [])]

        first = ids(7)
        assert ids(7) == first and ids(7, stream=True) == first  # same seed, same tokens
        assert ids(8) != first


# --- the text tracker ------------------------------------------------------------------------------------
def feed(tracker: Tracker, ids: list[int], per_event: int, finish: str = "length") -> list[str]:
    """Feed `ids` in events of `per_event` tokens (the last one final); the text handed out after each."""
    pieces = []
    for i in range(0, len(ids), per_event):
        part = ids[i : i + per_event]
        last = i + per_event >= len(ids)
        tracker.feed(Event(part, [0.0] * len(part), last, finish if last else None))
        pieces.append(tracker.take_text())
        if tracker.finished:
            break
    return pieces


@pytest.mark.parametrize("per_event", [1, 2, 3, 7])
def test_stop_string_across_tokens_and_utf8_is_cut(per_event):
    text = "naïve café: stop here — ünïcode"
    ids = TOK.encode(text)  # one token per byte: 'ï', 'é', '—', 'ü' span 2-3 tokens each
    for stop, want in (
        (": st", "naïve café"),
        ("é:", "naïve caf"),
        ("—", "naïve café: stop here "),
        ("ün", None),
    ):
        tr = Tracker(TOK.decode, [stop])
        pieces = feed(tr, ids, per_event)
        want = want if want is not None else text[: text.index(stop)]
        assert "".join(pieces) == want and tr.text == want
        assert tr.finish_reason == "stop"
        assert all("\ufffd" not in p for p in pieces)  # never half a character


@pytest.mark.parametrize("per_event", [1, 4])
def test_without_a_stop_the_whole_text_streams_and_partial_characters_wait(per_event):
    text = "日本語 and emoji 🙂 end"
    ids = TOK.encode(text)
    tr = Tracker(TOK.decode, [])
    pieces = feed(tr, ids, per_event)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert tr.finish_reason == "length"


def test_a_stop_token_is_counted_but_not_shown():
    ids = TOK.encode("abc") + [TOK.eos_token_id]
    tr = Tracker(TOK.decode, [])
    assert "".join(feed(tr, ids, 2, finish="stop")) == "abc"
    assert tr.ids == ids and tr.finish_reason == "stop"

"""No request can stop the server: a seeded storm of hostile requests against a live uvicorn server (tiny
model, prefix store on), then the same greedy text as before; and generated bodies against the parser
and the app (Hypothesis): every answer is 2xx or a 4xx in the OpenAI error shape."""

import asyncio
import json
from types import SimpleNamespace

import hostile
import httpx
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from servers import uvicorn_thread

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.engine.engine import Engine, EngineConfig
from serve.http.app import APIError, create_app
from serve.http.parsing import RequestParser, decode_body

GREEDY = {"temperature": 0, "ignore_eos": True}
BEFORE: list[str] = []  # the greedy texts served before any hostile request


@pytest.fixture(scope="module")
def live():
    model = HybridLM(load_config("tiny"), rngs=nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=64))
    app = create_app(engine, ByteTokenizer(512), "tiny", max_waiting=None, default_max_tokens=4)
    with uvicorn_thread(app, log_level="error") as url:
        BEFORE[:] = reference_texts(url)
        yield url, app


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
    result = hostile.send(url, hostile.storm(seed=15, n=1000), concurrency=16)
    assert result.dropped == []
    assert result.server_errors == 0, result.statuses
    assert result.bad_bodies == []
    assert sum(result.statuses.values()) == 1000
    assert reference_texts(url) == BEFORE


# --- generated bodies (Hypothesis) -------------------------------------------------------------------------
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates too
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | ANY_TEXT
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELD_VALUES = {
    "prompt": st.one_of(ANY_TEXT, st.lists(st.integers(-5, 600), max_size=8), JSONISH),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]), "content": ANY_TEXT})
        ),
        JSONISH,
    ),
    "max_tokens": st.one_of(st.integers(-2, 6), JSONISH),
    "temperature": st.one_of(st.floats(-1, 3), JSONISH),
    "top_p": st.one_of(st.floats(-0.5, 1.5), JSONISH),
    "top_k": st.one_of(st.integers(-2, 600), JSONISH),
    "seed": st.one_of(st.integers(-1, 2**33), JSONISH),
    "stop": st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=3), JSONISH),
    "stream": st.one_of(st.booleans(), JSONISH),
    "cache_salt": st.one_of(ANY_TEXT, JSONISH),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 3), JSONISH),
    "model": st.one_of(st.just("tiny"), ANY_TEXT),
    "ignore_eos": st.booleans(),
}


@st.composite
def bodies(draw, path=None):
    """Half of them start from a valid request for `path` (then up to two fields replaced), the rest are
    arbitrary combinations of known and unknown fields."""
    if path is not None and draw(st.booleans()):
        body = {"max_tokens": draw(st.integers(1, 3)), "temperature": 0, "ignore_eos": True}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": draw(st.text(max_size=8))}]
        else:
            body["prompt"] = draw(st.text(min_size=1, max_size=8) | st.lists(st.integers(3, 500), min_size=1))
        for key in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=2)):
            body[key] = draw(FIELD_VALUES[key])
        return body
    keys = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=6))
    body = {k: draw(FIELD_VALUES[k]) for k in keys}
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(ANY_TEXT, JSONISH, max_size=2)))
    return body


def raw(body) -> bytes:
    return json.dumps(body, ensure_ascii=True).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(bodies(), JSONISH), kind=st.sampled_from(["completion", "chat"]))
def test_the_parser_accepts_or_names_a_4xx_for_any_body(live, body, kind):
    _, app = live
    server = app.state.server
    try:
        prep = server.prepare(raw(body), kind)
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message
        assert set(exc.body()["error"]) == {"message", "type", "param", "code"}
        json.dumps(exc.body(), ensure_ascii=True)  # the answer can always be written
        return
    assert prep.prompt_ids and all(0 <= t < 512 for t in prep.prompt_ids)
    prep.params.validate(512)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_the_app_answers_any_body_with_2xx_or_a_shaped_4xx(live, data, path):
    _, app = live
    body = data.draw(bodies(path))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep generation short

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            return await client.post(path, content=raw(body), headers={"content-type": "application/json"})

    r = asyncio.run(go())
    event(f"status {r.status_code}")
    assert r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


NUMERIC_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "n",
    "best_of",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "prompt",
)
# integers up to the 4300 digits Python's JSON decoder takes: past about 309 digits float() overflows
HUGE_INTS = st.integers(1, 4299).flatmap(lambda n: st.integers(10 ** (n - 1), 10**n - 1)) | st.integers()
NUMBERS = st.one_of(
    HUGE_INTS, st.builds(int.__neg__, HUGE_INTS), st.floats(), st.lists(HUGE_INTS, max_size=3)
)


def stub_parser() -> RequestParser:
    """The parser of an engine with the `live` server's vocabulary and context, without a model."""
    engine = SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=512, eos_token_id=1),
        max_model_len=64,
        config=EngineConfig(),
        has_draft_model=False,
    )
    return RequestParser(engine, ByteTokenizer(512), "tiny", 4)


def test_a_401_digit_temperature_is_refused_with_400():
    """The issue's shape: float() of a 401-digit integer raises OverflowError, which was a 500."""
    parser = stub_parser()
    for name in ("temperature", "top_p"):
        with pytest.raises(APIError) as err:
            body = b'{"prompt": "a", "%s": 1%s}' % (name.encode(), b"0" * 400)
            parser.parse(decode_body(body), "completion")
        assert err.value.status == 400 and err.value.param == name


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(NUMERIC_FIELDS),
    value=NUMBERS,
    kind=st.sampled_from(["completion", "chat"]),
)
def test_every_numeric_field_takes_any_number_or_refuses_it_with_400(field, value, kind):
    """Any JSON number (an integer of up to 4299 digits, a float, a list of them) in any numeric field:
    the parser accepts it (and the settings validate) or raises a 400 naming that field."""
    body = {"prompt": "a"} if kind == "completion" else {"messages": [{"role": "user", "content": "a"}]}
    body[field] = value
    try:
        prep = stub_parser().parse(decode_body(raw(body)), kind)
    except APIError as exc:
        assert exc.status == 400 and exc.message, exc.body()
        json.dumps(exc.body(), ensure_ascii=True)
        return
    prep.params.validate(512)


def test_after_generated_bodies_the_greedy_text_is_unchanged(live):
    """Runs after the two property tests in this module (file order): the engine still serves the same."""
    url, _ = live
    assert reference_texts(url) == BEFORE


def test_requests_over_the_connection_limit_get_a_shaped_503():
    """A slow app behind the limit: two requests in progress, a third is refused at once; /health is not."""
    from serve.http.app import ConnectionLimit

    release = asyncio.Event()
    counted = []

    async def slow_app(scope, receive, send):
        if scope["path"] == "/v1/completions":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app = ConnectionLimit(slow_app, limit=2, count=lambda path, status: counted.append(status))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            held = [asyncio.ensure_future(client.post("/v1/completions", content=b"{}")) for _ in range(2)]
            await asyncio.sleep(0.05)
            over = await client.post("/v1/completions", content=b"{}")
            health = await client.get("/health")
            release.set()
            return over, health, [await h for h in held]

    over, health, held = asyncio.run(go())
    assert over.status_code == 503 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "too_many_connections"
    assert health.status_code == 200 and [h.status_code for h in held] == [200, 200]
    assert counted == [503] and app.active == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_fields_a_router_adds_at_their_no_op_values_are_accepted_and_any_other_value_refused(kind):
    """sglang-router forwards every request with `no_stop_trim`, `skip_special_tokens`, `return_hidden_states`
    (and `echo`) at its defaults: those values change nothing here, so they are accepted; any other is a 400
    naming the field."""
    parser = stub_parser()
    body = {"prompt": "a"} if kind == "completion" else {"messages": [{"role": "user", "content": "a"}]}
    router = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
    parser.parse({**body, **router}, kind)
    for name, value in (
        ("no_stop_trim", True),
        ("skip_special_tokens", False),
        ("return_hidden_states", True),
    ):
        with pytest.raises(APIError) as err:
            parser.parse({**body, name: value}, kind)
        assert err.value.status == 400 and err.value.param == name

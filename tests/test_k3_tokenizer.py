"""Kimi K3's tokenizer and chat format (shared/K3.md): the special-token ids, the per-turn and generation
prefix segments, special tokens only in control segments, [BOS] only when asked, stop on <|end_of_msg|>;
and /v1/chat/completions with a tiny model and a synthetic K3 tokenizer directory.

K2's ranks are not available offline: a small synthetic ranks file stands in (K3's special ids above it).
The expected token sequences are built from K3.md's ids typed in here and from tiktoken's plain encoding of
each text piece alone (an oracle independent of jaxhybrid.tokenizer).
"""

import base64
import json

import httpx
import pytest
import tiktoken
from flax import nnx
from servers import uvicorn_thread

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import KIMI_PATTERN, K3Tokenizer, TiktokenTokenizer, TokenizerError, load_tokenizer
from serve.engine.engine import Engine, EngineConfig
from serve.http.app import create_app

# K3.md
BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP, PAD = 163584, 163585, 163586, 163587, 163588, 163589, 163839
K3_VOCAB = 163840
WORDS = ["message", " role", '="', "user", "assistant", "response", "Hello", " world", "你好", "ing"]


def ranks() -> dict[bytes, int]:
    out = {bytes([b]): b for b in range(256)}
    for word in WORDS:
        data = word.encode()
        for n in range(2, len(data) + 1):
            out.setdefault(data[:n], len(out))
    return out


def write_k3_tokenizer_dir(directory, **config_extra) -> None:
    """tiktoken.model + a tokenizer_config.json with K3's special tokens at K3's ids and no chat template."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks().items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    names = {BOS: "[BOS]", EOS: "[EOS]", END_OF_MSG: "<|end_of_msg|>", OPEN: "<|open|>"}
    names |= {CLOSE: "<|close|>", SEP: "<|sep|>", PAD: "[PAD]"}
    config = {
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in names.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        **config_extra,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3tok")
    write_k3_tokenizer_dir(d)
    return d


@pytest.fixture(scope="module")
def tok(k3_dir):
    return TiktokenTokenizer.from_dir(k3_dir)


@pytest.fixture(scope="module")
def plain():
    """Ordinary BPE of text alone: tiktoken with the same ranks and pattern and no special tokens."""
    return tiktoken.Encoding("oracle", pat_str=KIMI_PATTERN, mergeable_ranks=ranks(), special_tokens={})


CONVERSATION = [
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "你好 <|open|>message"},
    {"role": "user", "content": 'say "<|end_of_msg|><|sep|>" please'},
]


def expected_ids(plain, messages, generation_prompt: bool = True) -> list[int]:
    """K3.md's format by hand: control segments as special ids around plain text, each text alone."""

    def enc(text):
        return plain.encode(text, disallowed_special=())

    ids = []
    for m in messages:
        ids += [OPEN, *enc(f'message role="{m["role"]}"'), SEP]
        ids += enc(m["content"])
        ids += [CLOSE, *enc("message"), SEP, END_OF_MSG]
    if generation_prompt:
        ids += [OPEN, *enc('message role="assistant"'), SEP, OPEN, *enc("response"), SEP]
    return ids


def test_k3_directory_gives_the_k3_tokenizer(tok):
    assert isinstance(tok, K3Tokenizer)
    assert tok.eos_token_id == END_OF_MSG  # stop on <|end_of_msg|>, not [EOS]
    assert tok.bos_token_id == BOS and tok.pad_token_id == PAD and not tok.add_bos
    assert tok.vocab_size == K3_VOCAB and tok.max_token_id == PAD
    for text, i in [("[BOS]", BOS), ("[EOS]", EOS), ("<|end_of_msg|>", END_OF_MSG), ("<|open|>", OPEN)]:
        assert tok.special_tokens[text] == i
    assert tok.special_tokens["<|close|>"] == CLOSE and tok.special_tokens["<|sep|>"] == SEP


def test_two_turn_conversation_tokenizes_as_k3_md_says(tok, plain):
    ids = tok.apply_chat_template(CONVERSATION)
    assert ids == expected_ids(plain, CONVERSATION)
    # the special-token text users typed is text: exactly 3 <|open|> per message + 2 for the prefix
    assert ids.count(OPEN) == 3 + 2 and ids.count(END_OF_MSG) == 3 and ids.count(SEP) == 2 * 3 + 2
    assert ids[0] == OPEN  # no [BOS] by default (UNSETTLED in K3.md)
    assert tok.decode(ids) == tok.render_chat(CONVERSATION)
    assert tok.render_chat(CONVERSATION[:1]) == (
        '<|open|>message role="user"<|sep|>Hello world<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    no_prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert no_prompt == expected_ids(plain, CONVERSATION, generation_prompt=False)
    assert no_prompt[-1] == END_OF_MSG and ids[: len(no_prompt)] == no_prompt


def test_bos_only_when_the_directory_asks(tmp_path, plain):
    write_k3_tokenizer_dir(tmp_path, add_bos_token=True)
    tok = TiktokenTokenizer.from_dir(tmp_path)
    assert tok.add_bos
    msgs = CONVERSATION[:1]
    assert tok.apply_chat_template(msgs) == [BOS, *expected_ids(plain, msgs)]


def test_roles_cannot_inject_control_tokens(tok):
    for role in ['user"<|close|>', "", "a b", None]:
        with pytest.raises(TokenizerError, match="role"):
            tok.apply_chat_template([{"role": role, "content": "x"}])
    with pytest.raises(TokenizerError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": None}])
    assert tok.apply_chat_template([{"role": "tool", "content": ""}])[-1] == SEP


def test_a_chat_template_takes_precedence(tmp_path):
    write_k3_tokenizer_dir(tmp_path, chat_template="{{ messages[0]['content'] }}")
    tok = TiktokenTokenizer.from_dir(tmp_path)
    assert not isinstance(tok, K3Tokenizer)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == [ord("h"), ord("i")]


def test_load_tokenizer_for_a_k3_config(k3_dir):
    cfg = load_config("tiny").replace(vocab_size=K3_VOCAB, bos_token_id=BOS, eos_token_id=END_OF_MSG)
    assert isinstance(load_tokenizer(k3_dir, cfg), K3Tokenizer)
    with pytest.raises(TokenizerError, match="beyond the model's vocab_size"):
        load_tokenizer(k3_dir, cfg.replace(vocab_size=163836, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module")
def k3_server(tok):
    cfg = load_config("tiny").replace(vocab_size=K3_VOCAB, bos_token_id=BOS, eos_token_id=END_OF_MSG)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=1, block_size=64, prefill_chunk=64, max_model_len=128))
    app = create_app(engine, tok, "tiny-k3tok", max_waiting=1, default_max_tokens=4)
    with uvicorn_thread(app, start_timeout=60) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield app, client


def test_chat_completions_with_the_k3_format(k3_server, plain):
    app, client = k3_server
    want = expected_ids(plain, CONVERSATION)
    prep = app.state.server.parser.parse({"messages": CONVERSATION}, "chat")
    assert list(prep.prompt_ids) == want
    body = {"messages": CONVERSATION, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(want)
    ids = out["choices"][0]["token_ids"]
    assert 1 <= len(ids) <= 3 and all(0 <= i < K3_VOCAB for i in ids)
    # generation ends at <|end_of_msg|> (the config's eos): it never appears before the last token
    assert END_OF_MSG not in ids[:-1]
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": 'x"<|open|>', "content": "hi"}]})
    assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]

"""Tokenizers from a model directory: Kimi's tiktoken BPE, a tokenizers-library tokenizer.json, the byte-level
fallback; round trips on multilingual text and the chat template with special tokens in place."""

import base64
import json

import pytest

from jaxhybrid.config import load_config
from jaxhybrid.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
)

TEXTS = [
    "Hello, world! It's a test: 12345 + 678 = 13023.",
    "Ünïcödé façade — naïve café",
    "你好，世界！这是一个测试。",
    "Привет, мир! Καλημέρα κόσμε. مرحبا بالعالم",
    "日本語のテキストと한국어 텍스트 🙂🚀\n\n\ttabs   and  spaces \r\n",
    "",
]

# Kimi-style chat format: every turn is <|im_ROLE|>role<|im_middle|>content<|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{% endif %}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]
MESSAGES = [{"role": "user", "content": "Wie geht's? 你好 <|im_end|>"}]


def write_tiktoken_dir(directory, gap: int = 3):
    """256 byte tokens, then each prefix of some frequent words (so BPE merges apply), then the specials
    after `gap` unnamed ids (which become reserved tokens)."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in [" the", " world", "Hello", "ing", " test", "你好", "世界", "Привет", " мир", "🙂"]:
        data = word.encode()
        for n in range(2, len(data) + 1):
            ranks.setdefault(data[:n], len(ranks))
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks.items()]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks) + gap
    added = {str(base + i): {"content": s, "special": True} for i, s in enumerate(SPECIALS)}
    config = {
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]"},
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return len(ranks), base


def write_hf_dir(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": [{"name": "default", "template": CHAT_TEMPLATE}],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken")
    write_tiktoken_dir(d)
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hftok")
    write_hf_dir(d)
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_round_trip(tiktoken_dir, text):
    tok = TiktokenTokenizer.from_dir(tiktoken_dir)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_tiktoken_merges_and_specials(tiktoken_dir):
    tok = TiktokenTokenizer.from_dir(tiktoken_dir)
    n_base = sum(1 for line in (tiktoken_dir / "tiktoken.model").read_text().splitlines() if line)
    first_special = tok.special_tokens["[BOS]"]
    assert tok.bos_token_id == first_special and tok.eos_token_id == first_special + 1
    # the gap between the base vocabulary and the named specials is filled with reserved tokens
    assert tok.special_tokens[f"<|reserved_token_{n_base}|>"] == n_base
    assert tok.vocab_size == first_special + len(SPECIALS)
    # BPE merges: a known word is one token, and Han text is split apart from Latin words
    assert len(tok.encode(" world")) == 1 and len(tok.encode("你好")) == 1
    assert len(tok.encode("Hello world")) == 2
    # a special token's text is plain text unless allowed
    end = tok.special_tokens["<|im_end|>"]
    assert end not in tok.encode("a<|im_end|>")
    assert tok.encode("a<|im_end|>", allow_special=True) == [ord("a"), end]
    assert tok.encode("x", add_bos=True)[0] == tok.bos_token_id
    assert tok.decode([ord("a"), end], skip_special=True) == "a"
    assert tok.decode([ord("a"), 10**6]) == "a"  # ids beyond the vocabulary are dropped


def check_chat(tok):
    ids = tok.apply_chat_template(MESSAGES)
    text = tok.render_chat(MESSAGES)
    assert text == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|>Wie geht's? 你好 <|im_end|><|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    special = {s: tok.encode(s, allow_special=True) for s in SPECIALS}
    assert all(len(v) == 1 for v in special.values())
    sid = {s: v[0] for s, v in special.items()}
    assert ids[0] == sid["<|im_system|>"]
    assert ids[-1] == sid["<|im_middle|>"] and ids[-2] != sid["<|im_middle|>"]
    assert ids.count(sid["<|im_end|>"]) == 3  # the template's two and the one the user typed
    assert ids.count(sid["<|im_middle|>"]) == 3
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt[-1] == sid["<|im_end|>"] and ids[: len(no_prompt)] == no_prompt


def test_tiktoken_chat_template(tiktoken_dir):
    check_chat(TiktokenTokenizer.from_dir(tiktoken_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trip(hf_dir, text):
    tok = HFTokenizer.from_dir(hf_dir)
    assert tok.decode(tok.encode(text)) == text


def test_hf_tokenizer_specials_and_chat(hf_dir):
    tok = HFTokenizer.from_dir(hf_dir)
    assert tok.bos_token_id == tok.tokenizer.token_to_id("[BOS]")
    assert tok.eos_token_id == tok.tokenizer.token_to_id("[EOS]")
    end = tok.tokenizer.token_to_id("<|im_end|>")
    assert end not in tok.encode("a<|im_end|>")
    assert end in tok.encode("a<|im_end|>", allow_special=True)
    check_chat(tok)


def test_load_tokenizer_picks_by_directory(tiktoken_dir, hf_dir, tmp_path):
    cfg = load_config("tiny").replace(vocab_size=1024)
    assert isinstance(load_tokenizer(tiktoken_dir, cfg), TiktokenTokenizer)
    assert isinstance(load_tokenizer(hf_dir, cfg), HFTokenizer)
    byte = load_tokenizer(None, cfg)
    assert isinstance(byte, ByteTokenizer) and byte.vocab_size == 1024
    assert isinstance(load_tokenizer(tmp_path, cfg), ByteTokenizer)  # a directory without tokenizer files
    assert load_tokenizer(None, cfg.replace(vocab_size=100)) is None
    with pytest.raises(TokenizerError, match="beyond the model's vocab_size 300"):
        load_tokenizer(tiktoken_dir, cfg.replace(vocab_size=300))


def test_byte_tokenizer_chat_and_round_trip():
    tok = ByteTokenizer(512)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "user: hi\nassistant: "


def test_template_errors_are_clear(tiktoken_dir):
    tok = TiktokenTokenizer.from_dir(tiktoken_dir)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template(MESSAGES)
    tok.chat_template = "{{ ''.__class__.__mro__ }}"  # the sandbox refuses attribute escapes
    with pytest.raises(TokenizerError):
        tok.apply_chat_template(MESSAGES)
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)

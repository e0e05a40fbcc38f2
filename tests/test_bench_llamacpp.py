"""`bench reference --against llama.cpp`'s glue, without llama.cpp: the tokenizer it gives llama.cpp against
ByteTokenizer, the parse of llama.cpp's output text back to ids, the config it writes, and the errors a user
without a built llama.cpp gets."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import llamacpp
from jaxhybrid.tokenizer import ByteTokenizer
from serve.cli import main

VOCAB = 600


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(llamacpp.byte_tokenizer_json(VOCAB))


# text as a client sends it: no NUL byte, and no lone surrogate (not encodable as UTF-8 at all)
TEXT = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=TEXT, max_size=40))
def test_the_tokenizer_llama_cpp_gets_encodes_as_byte_tokenizer(hf_tokenizer, text):
    """The oracle is ByteTokenizer (what `small` serves with): same ids for any text without a NUL byte
    (bytes 0x00 0x01 are the one merge llama.cpp requires)."""
    assert hf_tokenizer.encode(text, add_special_tokens=False).ids == ByteTokenizer(VOCAB).encode(text)


def test_every_id_has_a_token_and_the_specials_are_byte_tokenizers(hf_tokenizer):
    vocab = hf_tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(VOCAB))
    byte = ByteTokenizer(VOCAB)
    assert (vocab["<pad>"], vocab["<s>"], vocab["</s>"]) == (
        byte.pad_token_id,
        byte.bos_token_id,
        byte.eos_token_id,
    )
    assert vocab["<|unused_599|>"] == 599


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(3, VOCAB - 1).filter(lambda i: i != 259), max_size=30))
def test_output_text_parses_back_to_the_ids_that_printed_it(ids):
    """llama.cpp prints a byte token's byte and any other token's text; that parses back to the same ids."""
    text = b"".join(bytes([i - 3]) if i < 259 else f"<|unused_{i}|>".encode() for i in ids)
    assert llamacpp.output_ids(text) == ids


def test_export_writes_the_fields_llama_cpp_reads_and_links_the_weights(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "num_attention_heads": 8, "x": 1}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = llamacpp.export(str(src), tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {
        "vocab_size": VOCAB,
        "num_attention_heads": 8,
        "x": 1,
        "num_key_value_heads": 8,
        "moe_router_activation_func": "sigmoid",
    }
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["x"] == 1  # the checkpoint itself is untouched
    assert "num_key_value_heads" not in json.loads((src / "config.json").read_text())


def test_locate_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP", raising=False)
    with pytest.raises(llamacpp.LlamaCppError, match="--llama-cpp DIR"):
        llamacpp.locate(None)
    with pytest.raises(llamacpp.LlamaCppError, match="no built llama-bench"):
        llamacpp.locate(str(tmp_path))
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in llamacpp.TOOLS:
        (bin_dir / tool).write_text("")
    with pytest.raises(llamacpp.LlamaCppError, match="not a llama.cpp source tree"):
        llamacpp.locate(str(tmp_path))
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.locate(str(tmp_path)) == llamacpp.LlamaCpp(tmp_path, bin_dir)


def test_against_llama_cpp_without_one_is_one_error_line(capsys, monkeypatch, tmp_path):
    """The transformers side is replaced by stand-ins: the error must come from locating llama.cpp."""
    from benchmarks import reference

    monkeypatch.delenv("LLAMA_CPP", raising=False)
    monkeypatch.setattr(reference, "TorchModel", lambda directory: None)
    monkeypatch.setattr(reference, "OurModel", lambda directory, max_len: None)
    assert main(["bench", "reference", "--model", str(tmp_path), "--against", "llama.cpp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--llama-cpp DIR" in err[0]

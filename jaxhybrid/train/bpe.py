"""A small byte-level BPE tokenizer trained with the `tokenizers` library, written as `tokenizer.json` +
`tokenizer_config.json` so that `jaxhybrid.tokenizer.load_tokenizer` reads it (ids 0 pad, 1 bos, 2 eos,
as in the configs; a plain-text chat template)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jaxhybrid.tokenizer import DEFAULT_CHAT_TEMPLATE, HFTokenizer

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")


def train_bpe(texts: Sequence[str], vocab_size: int, directory: str | Path) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` ids (specials included) on `texts`; save and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"a byte-level BPE needs a vocabulary of at least 259 ids, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIALS[0],
        "bos_token": SPECIALS[1],
        "eos_token": SPECIALS[2],
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return HFTokenizer.from_dir(directory)


def encode_batch(tokenizer: HFTokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Ids of many texts at once (the library's parallel batch encoder), no special tokens added."""
    rust = tokenizer.tokenizer
    rust.encode_special_tokens = True  # special-token strings in a file are text, as in `encode`
    try:
        return [e.ids for e in rust.encode_batch(list(texts), add_special_tokens=False)]
    finally:
        rust.encode_special_tokens = False

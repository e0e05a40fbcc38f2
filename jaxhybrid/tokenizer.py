"""Tokenizers. `ByteTokenizer` lets random-weight configs take and give text: ids 0..2 are specials
(pad, bos, eos), byte b is id b + 3, so any vocabulary of at least 259 ids works."""

from __future__ import annotations


class ByteTokenizer:
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 256 + self.offset:
            raise ValueError(
                f"a byte-level tokenizer needs a vocabulary of at least 259 ids, got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special and out-of-byte-range ids are skipped, broken UTF-8 is replaced."""
        data = bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset)
        return data.decode("utf-8", errors="replace")

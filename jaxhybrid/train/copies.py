"""Copy documents: a span of tokens, the edit documents' request to write it again, and the span again.

A small model learns to copy what its context shows (induction) only where copying is what predicts the next
token. Two kinds of span teach it that, in equal numbers: uniformly random ids, where nothing but the earlier
copy predicts anything and the circuit forms within a few hundred steps; and windows of the training corpus
with up to `SUBSTITUTE_MAX` of their tokens replaced by random ids (the same ones in both copies), where code
the model would otherwise predict from what it has learned turns odd at unforeseen places, as unseen code
does, so the copy must win over the model's own guess. Random spans alone teach a model to copy random-
looking text and go on guessing in code. With an `alphabet` of N > 0, half of the random spans draw their ids
from a few (4 to N) ids, so that their short n-grams recur with different successors: only a longer match
(the last few tokens, as prompt lookup matches) says where a copy is, as in code, whose copies trip on
ambiguous n-grams once the plain circuit works. Documents are built in id space, from a generator seeded by
(seed, step), so a batch is a pure function of the run's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxhybrid.train.bpe import SPECIALS
from jaxhybrid.train.data import pack_documents
from jaxhybrid.train.edits import COPY_HEADER, UNCHANGED_REQUEST

# Span lengths in tokens (each copy document holds its span twice, so a row of `seq_len` tokens holds spans of
# at most about half of it: the longest drawn is the smaller of `longest`, by default MAX_SPAN, and that).
MIN_SPAN, MAX_SPAN = 16, 360
# A corpus span has a share drawn uniformly from [0, SUBSTITUTE_MAX) of its tokens replaced by random ids.
SUBSTITUTE_MAX = 0.4
# Ids below this are the BPE's special tokens (pad, bos, eos), never drawn as random ids.
FIRST_ORDINARY_ID = len(SPECIALS)
# The fewest ids a small-alphabet span draws from.
MIN_ALPHABET = 4


@dataclass(frozen=True)
class CopyFrame:
    """The token ids around a copy document's span: `bos header span request span eos`."""

    bos: int
    eos: int
    header: np.ndarray
    request: np.ndarray

    @staticmethod
    def encode(tok, bos: int, eos: int) -> CopyFrame:
        """The frame in `tok`'s ids (a tokenizer with `encode(text) -> list[int]`)."""
        return CopyFrame(
            bos,
            eos,
            np.asarray(tok.encode(COPY_HEADER), np.int32),
            np.asarray(tok.encode(UNCHANGED_REQUEST), np.int32),
        )

    def document(self, span: np.ndarray) -> np.ndarray:
        parts = [[self.bos], self.header, span, self.request, span, [self.eos]]
        return np.concatenate(parts).astype(np.int32)


def copy_span(
    rng: np.random.Generator, vocab: int, stream: np.ndarray | None, length: int, alphabet: int = 0
) -> np.ndarray:
    """`length` uniformly random ids (`stream` None; with `alphabet` N > 0, half the time from 4 to N ids
    drawn for the span), or a window of `stream` with a random share of up to SUBSTITUTE_MAX of its ids
    replaced by random ones."""
    if stream is None:
        if alphabet >= MIN_ALPHABET and rng.random() < 0.5:
            size = int(rng.integers(MIN_ALPHABET, alphabet + 1))
            ids = rng.choice(np.arange(FIRST_ORDINARY_ID, vocab), size, replace=False)
            return rng.choice(ids, length).astype(np.int32)
        return rng.integers(FIRST_ORDINARY_ID, vocab, length).astype(np.int32)
    start = int(rng.integers(0, len(stream) - length))
    span = np.array(stream[start : start + length], np.int32)
    replaced = rng.random(length) < rng.uniform(0.0, SUBSTITUTE_MAX)
    span[replaced] = rng.integers(FIRST_ORDINARY_ID, vocab, int(replaced.sum()))
    return span


def span_bound(frame: CopyFrame, corpus_tokens: int, seq_len: int, longest: int = MAX_SPAN) -> int:
    """The longest span a row of `seq_len + 1` tokens holds twice with its frame, at most `longest`; a
    ValueError where that is under MIN_SPAN or the corpus is not longer."""
    bound = min(longest, (seq_len + 1 - 2 - len(frame.header) - len(frame.request)) // 2)
    if bound < MIN_SPAN:
        raise ValueError(f"copy documents need a --seq-len that holds two spans of {MIN_SPAN} tokens")
    if corpus_tokens <= bound:
        raise ValueError(f"copy documents need a corpus of more than {bound} tokens, got {corpus_tokens}")
    return bound


def copy_rows(
    frame: CopyFrame,
    stream: np.ndarray,
    vocab: int,
    rows: int,
    seq_len: int,
    seed: int,
    step: int,
    alphabet: int = 0,
    longest: int = MAX_SPAN,
) -> np.ndarray:
    """`rows` sequences of `seq_len + 1` tokens of copy documents (cut at the row's end): the first half of
    the rows (rounded down) random-id spans (`alphabet`: see `copy_span`), the rest corpus spans with
    substitutions.
    int32 [rows, seq_len + 1]."""
    longest = span_bound(frame, len(stream), seq_len, longest)
    rng = np.random.default_rng([seed, step, 2])

    def document(row: int) -> np.ndarray:
        source = None if row < rows // 2 else stream
        length = int(rng.integers(MIN_SPAN, longest + 1))
        return frame.document(copy_span(rng, vocab, source, length, alphabet))

    return pack_documents(rows, seq_len, document)

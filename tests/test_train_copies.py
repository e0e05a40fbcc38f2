"""Copy documents (`jaxhybrid.train.copies`) and `train --copy-share`."""

from __future__ import annotations

import numpy as np
import pytest

from jaxhybrid.train import copies as C
from jaxhybrid.train import loop as L

VOCAB = 5000
FRAME = C.CopyFrame(1, 2, np.asarray([7, 8, 9], np.int32), np.asarray([11, 12, 13, 14], np.int32))
# A corpus whose every id names its position: a window of it is a run of consecutive ids.
STREAM = np.arange(1000, 4000, dtype=np.int32)


def documents(row: np.ndarray) -> list[np.ndarray]:
    """The spans of the copy documents a row holds, each checked to be framed and repeated as a document is
    (the last one possibly cut by the row's end)."""
    spans, at = [], 0
    while at < len(row):
        assert row[at] == FRAME.bos
        head = row[at + 1 : at + 1 + len(FRAME.header)]
        assert np.array_equal(head, FRAME.header[: len(head)])
        first = at + 1 + len(FRAME.header)
        if first >= len(row):
            break
        rest = row[first:]
        found = [
            i
            for i in range(C.MIN_SPAN, min(C.MAX_SPAN, len(rest)) + 1)
            if np.array_equal(rest[i : i + len(FRAME.request)], FRAME.request)
        ]
        if not found:  # the row ends inside the first copy of the span
            assert len(rest) < C.MAX_SPAN + len(FRAME.request)
            break
        n = found[0]
        span = rest[:n]
        again = rest[n + len(FRAME.request) : 2 * n + len(FRAME.request)]
        assert np.array_equal(again, span[: len(again)]), "the second copy differs from the first"
        end = first + 2 * n + len(FRAME.request)
        if end < len(row):
            assert row[end] == FRAME.eos
        spans.append(span)
        at = end + 1
    return spans


def test_copy_rows_hold_framed_spans_written_twice() -> None:
    rows = C.copy_rows(FRAME, STREAM, VOCAB, 4, 700, seed=3, step=5)
    assert rows.shape == (4, 701) and rows.dtype == np.int32
    assert np.array_equal(rows, C.copy_rows(FRAME, STREAM, VOCAB, 4, 700, seed=3, step=5))
    assert not np.array_equal(rows, C.copy_rows(FRAME, STREAM, VOCAB, 4, 700, seed=3, step=6))
    random_spans = [s for row in rows[:2] for s in documents(row)]
    corpus_spans = [s for row in rows[2:] for s in documents(row)]
    assert random_spans and corpus_spans
    for span in random_spans + corpus_spans:
        assert C.MIN_SPAN <= len(span) <= (701 - 9) // 2
        assert span.min() >= C.FIRST_ORDINARY_ID and span.max() < VOCAB
    # Random spans: ids from the whole vocabulary, hardly ever two consecutive ones.
    ids = np.concatenate(random_spans)
    assert np.mean(np.diff(ids) == 1) < 0.01 and ids.min() < 1000 and ids.max() >= 4000


def test_corpus_spans_are_windows_with_a_share_of_ids_substituted() -> None:
    """A corpus span is a window of the stream: most of its ids sit at their window position, and the
    substituted share is uniform over [0, SUBSTITUTE_MAX), so about SUBSTITUTE_MAX / 2 over many spans."""
    rows = C.copy_rows(FRAME, STREAM, VOCAB, 16, 2000, seed=0, step=1)
    shares = []
    for row in rows[8:]:
        for span in documents(row):
            offsets = span - np.arange(len(span))
            values, counts = np.unique(offsets, return_counts=True)
            start = values[counts.argmax()]
            kept = offsets == start
            assert STREAM[0] <= start <= STREAM[-1] - len(span) + 1
            shares.append(1.0 - kept.mean())
    assert len(shares) > 40
    assert max(shares) < C.SUBSTITUTE_MAX + 0.25  # a share drawn below 0.4, plus binomial spread on 16 ids
    assert abs(np.mean(shares) - C.SUBSTITUTE_MAX / 2) < 0.06


def test_a_batch_puts_copy_rows_last_and_shares_must_fit() -> None:
    cfg = L.TrainConfig(batch_size=8, seq_len=300, copy_share=0.25)
    copies = L.CopyData(FRAME, VOCAB, 2)
    batch = L._batch(cfg, STREAM, None, 4, copies)
    assert batch.shape == (8, 301)
    assert np.array_equal(batch[6:], C.copy_rows(FRAME, STREAM, VOCAB, 2, 300, cfg.seed, 4))
    for row in batch[:6]:  # corpus windows: consecutive ids
        assert np.all(np.diff(row) == 1)
    L._check(cfg)
    with pytest.raises(L.TrainError, match="--copy-share must lie in"):
        L._check(L.TrainConfig(copy_share=-0.1))
    with pytest.raises(L.TrainError, match="together take more than"):
        L._check(L.TrainConfig(batch_size=4, edit_share=0.75, copy_share=0.5))
    with pytest.raises(ValueError, match="more than 28 tokens"):  # spans of up to (65 - 9) // 2 tokens
        C.copy_rows(FRAME, STREAM[:20], VOCAB, 1, 64, 0, 0)
    with pytest.raises(ValueError, match="holds two spans of 16"):
        C.copy_rows(FRAME, STREAM, VOCAB, 1, 30, 0, 0)


def test_an_alphabet_makes_half_the_random_spans_draw_from_a_few_ids() -> None:
    """With `alphabet` 8, about half of the random spans use 4-8 distinct ids (their bigrams recur with
    other successors); without it, the same seed's spans use nearly as many ids as they have tokens."""
    few = [
        s for row in C.copy_rows(FRAME, STREAM, VOCAB, 16, 2000, 0, 1, alphabet=8)[:8] for s in documents(row)
    ]
    distinct = np.asarray([len(np.unique(s)) for s in few])
    small = distinct <= 8
    assert 0.3 < small.mean() < 0.7 and distinct[small].min() >= C.MIN_ALPHABET
    assert all(len(s) >= 16 for s in few)
    plain = [s for row in C.copy_rows(FRAME, STREAM, VOCAB, 16, 2000, 0, 1)[:8] for s in documents(row)]
    assert all(len(np.unique(s)) > 0.9 * len(s) for s in plain)
    with pytest.raises(L.TrainError, match="--copy-alphabet must be 0 or at least 4"):
        L._check(L.TrainConfig(copy_share=0.5, copy_alphabet=2))


def test_longest_bounds_the_spans() -> None:
    rows = C.copy_rows(FRAME, STREAM, VOCAB, 4, 700, 0, 2, longest=40)
    spans = [s for row in rows for s in documents(row)]
    assert spans and all(C.MIN_SPAN <= len(s) <= 40 for s in spans)
    assert max(len(s) for s in spans) > 30
    with pytest.raises(L.TrainError, match="--copy-longest must be at least 16"):
        L._check(L.TrainConfig(copy_share=0.5, copy_longest=8))


def test_a_run_whose_rows_cannot_hold_copies_is_a_train_error() -> None:
    """Checked when the run starts (before any step): a --seq-len too short for two spans, or a corpus no
    longer than a span, is an error naming --copy-share, not a traceback mid-run."""
    from types import SimpleNamespace

    tok = SimpleNamespace(encode=lambda text: [5] * len(text.split()), bos_token_id=1, eos_token_id=2)
    model_cfg = SimpleNamespace(vocab_size=64, bos_token_id=1, eos_token_id=2)
    built = L.CopyData.build(L.TrainConfig(copy_share=0.5, batch_size=4, seq_len=128), tok, model_cfg, 1000)
    assert built is not None and built.rows == 2 and built.vocab == 64
    assert L.CopyData.build(L.TrainConfig(), tok, model_cfg, 1000) is None
    with pytest.raises(L.TrainError, match="--copy-share: .*holds two spans"):
        L.CopyData.build(L.TrainConfig(copy_share=0.5, seq_len=30), tok, model_cfg, 1000)
    with pytest.raises(L.TrainError, match="--copy-share: .*corpus of more than"):
        L.CopyData.build(L.TrainConfig(copy_share=0.5, seq_len=128), tok, model_cfg, 40)

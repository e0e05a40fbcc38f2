"""Training corpus: files to documents, a deterministic train/validation split by file, token streams and
batches.

`--data stdlib` (the default) is the Python standard library's own `.py` source on this machine
(`sysconfig.get_paths()["stdlib"]`), without test directories, `site-packages` and build files: no
download, and the same files for the same Python version. A file goes to validation when the SHA-256 of
its path relative to its root falls in the first `val_fraction` of the hash range, so the split does not
depend on which other files exist. Each document is `[bos] + tokens + [eos]`; a split is the concatenation
of its documents in path order. Training batches are windows of `seq_len + 1` tokens drawn from the train
stream with a generator seeded by (seed, step): any step's batch is a pure function of the step, so a
resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STDLIB_ALIAS = "stdlib"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
# Directories left out of the stdlib corpus: the test suites and whatever is not the library's own source.
STDLIB_EXCLUDE = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload", "_bundled"}
)


class DataError(ValueError):
    """Bad `--data`: a missing path, no usable files, or an empty split."""


@dataclass(frozen=True)
class Document:
    """One source file: `name` is its path relative to its root (what the split hashes)."""

    name: str
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path) -> bool:
    return any(part in STDLIB_EXCLUDE or part.startswith("config-") for part in rel.parts[:-1])


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """The standard library's `.py` files sorted by relative path; test suites and site-packages left out."""
    root = root or stdlib_root()
    docs = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _excluded(rel) and path.is_file():
            docs.append(Document(rel.as_posix(), path))
    return sorted(docs, key=lambda d: d.name)


def collect_documents(specs: Sequence[str]) -> list[Document]:
    """Documents of each `--data` entry: `stdlib`, a text file, or a directory (its `.py .txt .md .rst`
    files). Raises DataError for a missing path or when nothing is found."""
    docs: list[Document] = []
    for spec in specs:
        if spec == STDLIB_ALIAS:
            docs.extend(stdlib_documents())
            continue
        path = Path(spec)
        if not path.exists():
            raise DataError(f"--data {spec}: no such file or directory (or use '{STDLIB_ALIAS}')")
        if path.is_file():
            docs.append(Document(path.name, path))
            continue
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not found:
            raise DataError(f"--data {spec}: no {' '.join(TEXT_SUFFIXES)} files in this directory")
        docs.extend(Document(p.relative_to(path).as_posix(), p) for p in found)
    return docs


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether the file named `name` (relative path) belongs to the validation split."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2**64


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, validation) by the hash of each file's relative path; both must be non-empty."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"the validation fraction must lie in (0, 1), got {val_fraction}")
    train = [d for d in docs if not is_validation(d.name, val_fraction)]
    val = [d for d in docs if is_validation(d.name, val_fraction)]
    if not train or not val:
        raise DataError(
            f"{len(docs)} file(s) give {len(train)} for training and {len(val)} for validation: "
            "give more files (the split is by file)"
        )
    return train, val


def read_text(doc: Document) -> str:
    return doc.path.read_text(encoding="utf-8", errors="replace")


def read_texts(docs: Sequence[Document]) -> list[str]:
    """File contents (undecodable bytes replaced); raises DataError when all of them are empty."""
    texts = [read_text(d) for d in docs]
    if not any(t.strip() for t in texts):
        raise DataError("the corpus is empty: every file is blank")
    return texts


def token_stream(
    texts: Sequence[str], encode_batch: Callable[[list[str]], list[list[int]]], bos: int, eos: int
) -> np.ndarray:
    """`[bos] + ids + [eos]` of every non-blank text, concatenated: int32 [N]."""
    ids = encode_batch([t for t in texts if t.strip()])
    parts = [np.asarray([bos, *x, eos], np.int32) for x in ids]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def train_batch(stream: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Batch `step` of the run: `batch` windows of `seq_len + 1` tokens at positions drawn from a generator
    seeded by (seed, step): int32 [batch, seq_len + 1]."""
    span = seq_len + 1
    if len(stream) < span:
        raise DataError(f"the training split has {len(stream)} tokens, fewer than one sequence ({span})")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - span + 1, size=batch)
    return np.stack([stream[s : s + span] for s in starts])


def pack_documents(rows: int, seq_len: int, next_document: Callable[[int], np.ndarray]) -> np.ndarray:
    """`rows` sequences of `seq_len + 1` tokens, each filled from its first token with the documents
    `next_document(row)` returns, in turn, the last one cut at the row's end: int32 [rows, seq_len + 1]."""
    out = np.empty((rows, seq_len + 1), np.int32)
    for r in range(rows):
        filled = 0
        while filled < seq_len + 1:
            doc = next_document(r)[: seq_len + 1 - filled]
            out[r, filled : filled + len(doc)] = doc
            filled += len(doc)
    return out


def share_rows(batch: int, share: float) -> int:
    """How many of a batch's `batch` rows a share `share` of them is (0 < share <= 1: at least one)."""
    return 0 if share <= 0 else max(1, min(batch, round(batch * share)))


def val_batches(stream: np.ndarray, batch: int, seq_len: int, max_batches: int) -> Iterator[np.ndarray]:
    """Consecutive non-overlapping windows of the validation stream, `batch` at a time, at most
    `max_batches` batches (a final short batch is dropped): the same tokens at every evaluation."""
    span = seq_len + 1
    n = min(len(stream) // span, batch * max_batches) // batch * batch
    if n == 0:
        raise DataError(
            f"the validation split has {len(stream)} tokens, fewer than one batch ({batch} x {span})"
        )
    windows = stream[: n * span].reshape(n, span)
    for i in range(0, n, batch):
        yield windows[i : i + batch]


def unigram_counts(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token frequencies of a stream: int64 [vocab_size] (the unigram baseline's statistics)."""
    return np.bincount(stream, minlength=vocab_size).astype(np.int64)


def unigram_cross_entropy(counts: np.ndarray, targets: np.ndarray) -> float:
    """Cross-entropy in nats/token of `targets` under the add-one smoothed unigram model of `counts`."""
    probs = (counts + 1.0) / (counts.sum() + len(counts))
    return float(-np.log(probs[targets]).mean())

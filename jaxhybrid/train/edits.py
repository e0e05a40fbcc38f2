"""Edit documents: a function of the corpus, a request to write it again (unchanged, or with one argument
renamed) and the function so written.

A model trained on source files alone rarely sees code repeated within its context, and asked to write a
function again it writes something like it instead (the shipped model before `--edit-share`). These
documents teach it to copy what it is shown, which is what code editing asks of a model and what prompt-
lookup drafts (speculative decoding) predict. Each function gets one template, chosen by the SHA-256 of its
code, so the documents are a pure function of the corpus; they come from the split their file is in.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxhybrid.train.data import pack_documents

# Functions of this many lines (signature to last line) become documents: long enough to be worth copying,
# short enough that the pair fits a training sequence.
MIN_LINES, MAX_LINES = 3, 40
# The names a renamed argument takes (the first not already in the function).
NEW_NAMES = ("value", "item", "data", "name", "obj", "result", "arg", "key", "entry", "other")
# What comes before the code to copy, and the request to write it again that follows it.
COPY_HEADER = "# Original:\n"
UNCHANGED_REQUEST = "\n\n# The same function, unchanged:\n"


@dataclass(frozen=True)
class Function:
    """A function's source, dedented, and its argument names other than self / cls."""

    code: str
    args: tuple[str, ...]


def unchanged_prompt(code: str) -> str:
    """The request to write `code` again unchanged, up to the end of its first line (a prompt). It stops
    before the line's newline: a byte-level BPE merges a newline with the next line's indent, so a prompt
    that ends in a bare newline ends in a token that, in source, precedes an unindented line."""
    return f"{COPY_HEADER}{code}{UNCHANGED_REQUEST}{code.splitlines()[0]}"


def unchanged_completion(code: str) -> str:
    """What follows `unchanged_prompt(code)` when the function is written again unchanged: its other lines."""
    return "\n" + "\n".join(code.splitlines()[1:])


def functions(text: str) -> list[Function]:
    """The functions and methods of a Python source of MIN_LINES .. MAX_LINES lines, dedented, in source
    order (none where the text does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    found = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        if not MIN_LINES <= node.end_lineno - node.lineno + 1 <= MAX_LINES:
            continue
        body = lines[node.lineno - 1 : node.end_lineno]
        indent = len(body[0]) - len(body[0].lstrip())
        if any(line.strip() and line[:indent].strip() for line in body):
            continue  # a line left of the signature (a continued string): not a clean block
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        names = tuple(a.arg for a in args if a.arg not in ("self", "cls"))
        found.append(Function("\n".join(line[indent:] for line in body), names))
    return found


def rename(code: str, old: str, new: str) -> str:
    """`code` with every whole-word `old` replaced by `new` (docstrings and comments too)."""
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def edit_document(fn: Function) -> str:
    """One document for `fn`: unchanged (a third of the functions, and those without arguments), or with an
    argument renamed under one of two phrasings."""
    h = int.from_bytes(hashlib.sha256(fn.code.encode("utf-8")).digest()[:8], "big")
    kind, args = h % 3, [a for a in fn.args if len(a) > 1]
    if kind == 0 or not args:
        return unchanged_prompt(fn.code) + unchanged_completion(fn.code) + "\n"
    old = args[(h // 3) % len(args)]
    new = next((n for n in NEW_NAMES if not re.search(rf"\b{n}\b", fn.code)), old + "_new")
    after = rename(fn.code, old, new)
    if kind == 1:
        return f"{COPY_HEADER}{fn.code}\n\n# The same function with `{old}` renamed to `{new}`:\n{after}\n"
    return f"# Before:\n{fn.code}\n\n# After (rename `{old}` to `{new}`):\n{after}\n"


def edit_documents(texts: Sequence[str]) -> list[str]:
    """An edit document for each function of each text, in order."""
    return [edit_document(fn) for text in texts for fn in functions(text)]


def edit_rows(docs: Sequence[np.ndarray], rows: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """`rows` sequences of `seq_len + 1` tokens, each starting at a document's first token (documents drawn
    by a generator seeded by (seed, step), concatenated until the row is full): int32 [rows, seq_len + 1]."""
    rng = np.random.default_rng([seed, step, 1])
    return pack_documents(rows, seq_len, lambda _row: docs[rng.integers(len(docs))])

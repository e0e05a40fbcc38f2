"""README's command table against the parsers: every flag a row names exists; a row shows a flag bare
(outside `[...]` and `(... | ...)`) exactly when argparse requires it, and `(a | b)` only where one of them
is required."""

import argparse
import re
from pathlib import Path

import pytest

from serve.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def command_rows() -> list[str]:
    """The command cell (first code span) of every row of README's command table."""
    rows = []
    for line in README.read_text().splitlines():
        m = re.match(r"\| `(jaxhybrid [^`]*)`", line)
        if m:
            rows.append(m.group(1).replace("\\|", "|"))
    return rows


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def parser_of(cell: str) -> tuple[str, argparse.ArgumentParser]:
    words = cell.split()[1:]
    p = subparser(build_parser(), words[0])
    if words[0] == "bench":
        return f"bench {words[1]}", subparser(p, words[1])
    return words[0], p


def flags_in(cell: str) -> tuple[list[tuple[str, bool]], list[frozenset[str]]]:
    """(flag, shown bare) for every `--flag` of a command cell, bare meaning outside [...] and (...); and the
    flags of each top-level `(a | b)` group."""
    out, groups, stack = [], [], []
    for token in re.finditer(r"--[a-z][a-z0-9-]*|[\[\]()]", cell):
        t = token.group()
        if t in "[(":
            stack.append((t, set()))
        elif t in "])":
            kind, flags = stack.pop()
            if kind == "(" and not stack:
                groups.append(frozenset(flags))
            elif stack:
                stack[-1][1].update(flags)
        else:
            out.append((t, not stack))
            if stack:
                stack[-1][1].add(t)
    return out, groups


# Flags a row shows bare or as `(a | b)` that argparse cannot require, checked when the command runs:
# `memory`'s rows are its modes (--context, --turns with --turn-tokens, --ratios), `bench prefix --simulate`
# is a row of its own, `bench reference` compares on --model's weights (or writes them with --make-small),
# `convert --quantize-experts` and `bench decode --compare-dequantized` are rows of their own, and
# `generate` takes exactly one source of prompts.
AT_RUN_TIME = {
    "convert": {"--quantize-experts"},
    "bench decode": {"--compare-dequantized"},
    "memory": {"--context", "--turns", "--turn-tokens", "--ratios"},
    "bench prefix": {"--simulate"},
    "bench reference": {"--model"},
}
ONE_OF_AT_RUN_TIME = {"generate": {frozenset({"--prompt-ids", "--prompt", "--prompts-file"})}}


ROWS = command_rows()


def test_the_table_is_found():
    assert len(ROWS) >= 15 and any(r.startswith("jaxhybrid generate") for r in ROWS)


@pytest.mark.parametrize("cell", ROWS, ids=[" ".join(r.split()[1:3]) for r in ROWS])
def test_a_readme_row_matches_its_parser(cell):
    name, parser = parser_of(cell)
    options = {s: a for a in parser._actions for s in a.option_strings}
    named, groups = flags_in(cell)
    unknown = sorted({f for f, _ in named} - set(options))
    assert not unknown, f"README names flags `jaxhybrid {name}` does not have: {unknown}"
    bare = {f for f, is_bare in named if is_bare}
    required = {a.option_strings[0] for a in parser._actions if a.required and a.option_strings}
    assert required <= bare, f"`jaxhybrid {name}` requires {sorted(required - bare)}: show them bare"
    extra = bare - required - AT_RUN_TIME.get(name, set())
    assert not extra, f"`jaxhybrid {name}` does not require {sorted(extra)}: use [...]"
    one_of = {
        frozenset(a.option_strings[0] for a in g._group_actions)
        for g in parser._mutually_exclusive_groups
        if g.required
    } | ONE_OF_AT_RUN_TIME.get(name, set())
    for group in groups:
        assert group in one_of, f"`jaxhybrid {name}` requires none of {sorted(group)}: use [... | ...]"

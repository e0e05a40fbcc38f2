"""The docs against the code: every `jaxhybrid ...` command in a fenced code block of README.md and docs/*.md
parses with the CLI's parser; docs/cli.md has a section for every command; every relative link in them
resolves to a file of the repository (none goes to shared/ or outside); and the command table of docs/cli.md
matches the parsers: every flag a row names exists, a row shows a flag bare (outside `[...]` and
`(... | ...)`) exactly when argparse requires it, and `(a | b)` only where one of them is required."""

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from serve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI_DOC = ROOT / "docs" / "cli.md"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- every command in a code block parses ----


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a ``` fenced block."""
    out, inside = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            out.append((n, line))
    return out


def doc_commands(path: Path) -> list[tuple[str, str]]:
    """(`file:line`, command) of every `jaxhybrid` command line in the fenced blocks of `path`, with its `\\`
    continuation lines joined and leading `VAR=value` assignments left out."""
    found, pending, start = [], "", 0
    for n, line in fenced_lines(path.read_text()):
        if not pending:
            start = n
        pending += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words and words[0] == "jaxhybrid":
            if words[-1] == "&":
                words = words[:-1]
            found.append((f"{rel(path)}:{start}", shlex.join(words)))
    return found


COMMANDS = [c for path in DOCS for c in doc_commands(path)]


def test_the_docs_commands_are_found():
    assert len(COMMANDS) >= 40
    names = {shlex.split(c)[1] for _, c in COMMANDS}
    assert {"serve", "generate", "plan", "train", "bench", "route", "info", "memory", "convert"} <= names


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_docs_command_parses(where, command):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{command}` does not parse: {err.getvalue().strip().splitlines()[-1:]}")


def command_names() -> list[str]:
    """`info`, ..., `bench decode`, ...: every command and bench subcommand the parser has."""
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = []
    for name, parser in top.choices.items():
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        names += [f"{name} {s}" for s in sub[0].choices] if sub else [name]
    return names


def test_every_command_has_a_section_in_the_cli_doc():
    sections = set(re.findall(r"^## (.+)$", CLI_DOC.read_text(), re.MULTILINE))
    missing = [n for n in command_names() if n not in sections]
    assert not missing, f"docs/cli.md has no `## NAME` section for: {missing}"


# ---- every relative link resolves inside the repository ----

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path) -> list[str]:
    """Link targets of `path`, outside fenced blocks and code spans."""
    text, inside, prose = path.read_text(), False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            prose.append(re.sub(r"`[^`]*`", "", line))
    return LINK.findall("\n".join(prose))


LINKS = [(path, target) for path in DOCS for target in dict.fromkeys(links(path))]


def test_the_docs_links_are_found():
    assert any(t == "docs/design.md" for _, t in LINKS) and any(p.parent.name == "docs" for p, _ in LINKS)


@pytest.mark.parametrize("path,target", LINKS, ids=[f"{rel(p)}->{t}" for p, t in LINKS])
def test_a_docs_link_resolves_inside_the_repository(path, target):
    assert "://" not in target and not target.startswith("mailto:"), (
        f"{rel(path)} links outside the repository: {target} (the docs stand alone)"
    )
    file = target.split("#", 1)[0]
    if not file:  # an anchor in the same page
        return
    resolved = (path.parent / file).resolve()
    assert resolved.is_relative_to(ROOT), f"{rel(path)} links outside the repository: {target}"
    assert not resolved.is_relative_to(ROOT / "shared"), f"{rel(path)} links into shared/: {target}"
    assert resolved.exists(), f"{rel(path)} links to a file that does not exist: {target}"


# ---- the command table of docs/cli.md against the parsers ----


def command_rows() -> list[str]:
    """The command cell (first code span) of every row of docs/cli.md's command table."""
    rows = []
    for line in CLI_DOC.read_text().splitlines():
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
def test_a_table_row_matches_its_parser(cell):
    name, parser = parser_of(cell)
    options = {s: a for a in parser._actions for s in a.option_strings}
    named, groups = flags_in(cell)
    unknown = sorted({f for f, _ in named} - set(options))
    assert not unknown, f"docs/cli.md names flags `jaxhybrid {name}` does not have: {unknown}"
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

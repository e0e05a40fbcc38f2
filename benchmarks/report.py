"""How every research benchmark ends: its tables and notes on stderr, then its result as one JSON line on
stdout (and to `--out`), so a run's stdout is its result alone and a reader sees the figures as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from serve.bench.common import emit
from serve.report import print_table

# a column's cell from its value: a format spec (".2f") or a function
Format = str | Callable[[Any], str]


@dataclasses.dataclass(frozen=True)
class Table:
    """Rows (dicts) over `columns`, each cell the row's value under the column's name, written through
    `formats[column]` where there is one (other columns as they are); `title`: a line above the table."""

    rows: Sequence[Mapping[str, Any]]
    columns: Sequence[str]
    formats: Mapping[str, Format] = dataclasses.field(default_factory=dict)
    title: str | None = None

    def cells(self) -> list[dict[str, Any]]:
        out = []
        for row in self.rows:
            cells = dict(row)
            for column, fmt in self.formats.items():
                if column in row:
                    cells[column] = fmt(row[column]) if callable(fmt) else format(row[column], fmt)
            out.append(cells)
        return out


def or_dash(spec: str) -> Callable[[Any], str]:
    """The format `spec`, or "-" for a value that is None (a figure a row does not have)."""
    return lambda value: "-" if value is None else format(value, spec)


def show(*parts: Table | str) -> None:
    """Each part on stderr, in order: a table aligned under its title, a string as a line."""
    for part in parts:
        if isinstance(part, Table):
            if part.title is not None:
                print(part.title, file=sys.stderr)
            print_table(part.cells(), list(part.columns), file=sys.stderr)
        else:
            print(part, file=sys.stderr)


def report(result: dict[str, Any], args: argparse.Namespace, *parts: Table | str) -> int:
    """`show(*parts)`, then the result as one JSON line on stdout and to `args.out` (if given). Returns 0,
    the exit status of a run that got this far."""
    show(*parts)
    emit(result, args)
    return 0

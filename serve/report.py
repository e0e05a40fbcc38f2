"""Formatting shared by the commands and the benchmarks: counts, byte sizes, aligned tables."""

from __future__ import annotations

from typing import TextIO

DTYPES = ("bfloat16", "float32", "float16")


def positive_ints(text: str, flag: str) -> list[int]:
    """A command-line list `1,2,3` as sorted distinct positive integers (ValueError naming `flag`)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag} must be positive integers, got {text!r}")
    return values


def fmt_count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def print_table(rows: list[dict], columns: list[str], file: TextIO | None = None) -> None:
    """A plain aligned text table of `rows` (dicts) over `columns` (to stdout unless `file`)."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), file=file)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)), file=file)

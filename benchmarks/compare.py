"""`jaxhybrid bench compare A.json B.json [...] --out-dir DIR`: several results of one bench side by side.

Reads JSON results written by `jaxhybrid bench KIND --out FILE` (all of one kind: throughput, decode,
ttft, prefix, mesh, load or serve), prints one table with a column per file for each metric (files are named
A, B, ... with a legend; the headline metric also gets each file's ratio to A), and with --out-dir writes
PNG plots (matplotlib, Agg), one line or bar series per file. Runs nothing; only reads the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import sys
from pathlib import Path
from typing import Any

from serve.report import print_table


class CompareError(ValueError):
    """A result file that cannot be compared; printed as `error: ...` with exit status 2."""


@dataclasses.dataclass(frozen=True)
class Section:
    """One list of rows in a result: `keys` identify a row across files, `metrics` are compared (the first
    is the headline, which also gets a ratio column)."""

    field: str
    keys: tuple[str, ...]
    metrics: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plot:
    """One figure: `y` against `x` from a section's rows, one series per file (and per `group` value).
    A numeric `x` gives lines with markers (a log y axis when the values span more than 30x), a text `x`
    grouped bars; `scale` multiplies y for its unit."""

    name: str
    section: str
    x: str
    y: str
    title: str
    xlabel: str
    ylabel: str
    group: str | None = None
    scale: float = 1.0
    logx: bool = False


KINDS: dict[str, tuple[tuple[Section, ...], tuple[Plot, ...]]] = {
    "throughput": (
        (
            Section("prefill", ("prompt_len",), ("tokens_per_s", "matmul_fraction")),
            Section("decode", ("batch", "context"), ("tokens_per_s", "bandwidth_fraction")),
        ),
        (
            Plot(
                "prefill",
                "prefill",
                "prompt_len",
                "tokens_per_s",
                "Prefill throughput (batch 1, one program call per prompt)",
                "prompt length (tokens)",
                "prefill throughput (tokens/s)",
                logx=True,
            ),
            Plot(
                "decode",
                "decode",
                "batch",
                "tokens_per_s",
                "Decode throughput (all rows of one step)",
                "batch size (sequences)",
                "decode throughput (tokens/s)",
                group="context",
                logx=True,
            ),
            Plot(
                "prefill_fraction",
                "prefill",
                "prompt_len",
                "matmul_fraction",
                "Prefill model FLOP/s as a share of the measured matmul rate",
                "prompt length (tokens)",
                "of the machine's matmul FLOP/s (%)",
                scale=100.0,
                logx=True,
            ),
            Plot(
                "decode_fraction",
                "decode",
                "batch",
                "bandwidth_fraction",
                "Decode bytes read per second as a share of the measured read bandwidth",
                "batch size (sequences)",
                "of the machine's read bandwidth (%)",
                group="context",
                scale=100.0,
                logx=True,
            ),
        ),
    ),
    "decode": (
        (Section("rows", ("variant", "context"), ("step_ms", "tokens_per_s")),),
        (
            Plot(
                "step",
                "rows",
                "context",
                "step_ms",
                "Decode step time vs context",
                "context (tokens)",
                "decode step time (ms, median)",
                group="variant",
                logx=True,
            ),
        ),
    ),
    "ttft": (
        (Section("rows", ("variant",), ("ttft_ms", "speedup_vs_cold", "checkpoint_bytes")),),
        (
            Plot(
                "ttft",
                "rows",
                "variant",
                "ttft_ms",
                "Time to first token of the follow-up prompt",
                "prefix store",
                "time to first token (ms)",
            ),
        ),
    ),
    "prefix": (
        (
            Section(
                "rows",
                ("workload", "setting", "budget_kib"),  # a result holds each setting per workload and budget
                ("ttft_mean_ms", "hit_rate", "recomputed_tokens", "ttft_p95_ms", "prompt_tokens_computed"),
            ),
        ),
        (
            Plot(
                "ttft",
                "rows",
                "setting",
                "ttft_mean_ms",
                "Mean time to first token on the multi-turn workload",
                "prefix store setting",
                "mean time to first token (ms)",
            ),
        ),
    ),
    "mesh": (
        (Section("rows", ("mesh",), ("decode_tokens_per_s", "param_bytes_per_device", "step_ms")),),
        (
            Plot(
                "decode",
                "rows",
                "mesh",
                "decode_tokens_per_s",
                "Decode throughput per mesh shape",
                "mesh",
                "decode throughput (tokens/s)",
            ),
        ),
    ),
    "serve": (
        (
            Section(
                "rows",
                ("request_rate",),
                (
                    "output_throughput",
                    "request_throughput",
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "tpot_p50_ms",
                    "tpot_p99_ms",
                    "itl_p50_ms",
                    "itl_p99_ms",
                    "prefix_hit_tokens",
                    "failed",
                ),
            ),
        ),
        (
            Plot(
                "ttft",
                "rows",
                "request_rate",
                "ttft_p50_ms",
                "Median time to first token vs request rate",
                "request rate (requests/s)",
                "time to first token, p50 (ms)",
            ),
            Plot(
                "tpot",
                "rows",
                "request_rate",
                "tpot_p50_ms",
                "Median time per output token vs request rate",
                "request rate (requests/s)",
                "time per output token, p50 (ms)",
            ),
            Plot(
                "throughput",
                "rows",
                "request_rate",
                "output_throughput",
                "Output-token throughput vs request rate",
                "request rate (requests/s)",
                "output tokens/s",
            ),
        ),
    ),
    "load": (
        (Section("rows", ("format",), ("load_s", "peak_rss_bytes", "checkpoint_bytes")),),
        (
            Plot(
                "load",
                "rows",
                "format",
                "load_s",
                "Checkpoint load time",
                "checkpoint format",
                "load time (s)",
            ),
        ),
    ),
}


def read_results(paths: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """(kind, results) of the files, checked: each exists, is a JSON object of a supported bench kind with
    the rows that kind needs, and all are of one kind. Raises CompareError naming the file."""
    if len(paths) > len(string.ascii_uppercase):
        raise CompareError(f"at most {len(string.ascii_uppercase)} files at once, got {len(paths)}")
    results = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise CompareError(f"no such result file: {path}")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CompareError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or "bench" not in data:
            raise CompareError(f"{path} is not a jaxhybrid bench result (no 'bench' field)")
        kind = data["bench"]
        if kind not in KINDS:
            raise CompareError(
                f"{path}: bench kind {kind!r} cannot be compared (supported: {', '.join(KINDS)})"
            )
        for section in KINDS[kind][0]:
            rows = data.get(section.field)
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise CompareError(f"{path}: a {kind} result needs a list of rows in {section.field!r}")
        results.append(data)
    kinds = {r["bench"] for r in results}
    if len(kinds) > 1:
        listing = ", ".join(f"{p} is {r['bench']}" for p, r in zip(paths, results, strict=True))
        raise CompareError(f"the files are of different bench kinds ({listing}); compare one kind at a time")
    return results[0]["bench"], results


def labels_for(paths: list[str], results: list[dict[str, Any]]) -> list[str]:
    """A legend label per file: device kind, dtype and config; the file name is added when two would clash."""
    base = []
    for r in results:
        env = r.get("environment", {})
        parts = [
            env.get("device_kind") or env.get("platform"),
            r.get("dtype"),
            r.get("config"),
            r.get("label"),
        ]
        base.append(" ".join(str(p) for p in parts if p) or "result")
    return [
        f"{b} ({Path(p).name})" if base.count(b) > 1 or b == "result" else b
        for b, p in zip(base, paths, strict=True)
    ]


def _fmt(metric: str, value: Any) -> str:
    if value is None:
        return "-"
    if metric.endswith("_fraction") and isinstance(value, int | float):
        return f"{100 * value:.1f}%"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"


def _key(row: dict[str, Any], keys: tuple[str, ...]) -> tuple:
    return tuple(row.get(k) for k in keys)


def _order(value: Any) -> tuple:
    """Numbers ascending, then text."""
    return (0, value, "") if isinstance(value, int | float) else (1, 0, str(value))


def table_rows(section: Section, results: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[str]]:
    """The side-by-side rows of one section: the union of row keys over files (first-seen order for text
    keys, ascending for numbers), a column per metric and file, and each later file's headline ratio to A."""
    ids = string.ascii_uppercase[: len(results)]
    indexed = [{_key(r, section.keys): r for r in res[section.field]} for res in results]
    keys: list[tuple] = []
    for index in indexed:
        keys += [k for k in index if k not in keys]
    if all(isinstance(v, int | float) for k in keys for v in k):
        keys.sort(key=lambda k: tuple(_order(v) for v in k))
    head = section.metrics[0]
    columns = list(section.keys)
    for metric in section.metrics:
        columns += [f"{metric} {i}" for i in ids]
        if metric == head:
            columns += [f"{i}/A" for i in ids[1:]]
    rows = []
    for key in keys:
        row = dict(zip(section.keys, (str(v) for v in key), strict=True))
        for metric in section.metrics:
            values = [index.get(key, {}).get(metric) for index in indexed]
            row.update({f"{metric} {i}": _fmt(metric, v) for i, v in zip(ids, values, strict=True)})
            if metric == head:
                for i, v in zip(ids[1:], values[1:], strict=True):
                    ok = isinstance(v, int | float) and isinstance(values[0], int | float) and values[0]
                    row[f"{i}/A"] = f"{v / values[0]:.2f}" if ok else "-"
        rows.append(row)
    return rows, columns


def build_figures(kind: str, results: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """name -> matplotlib Figure (Agg canvas) for each plot of `kind`, one series per file (and group)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figures = {}
    sections = {s.field: s for s in KINDS[kind][0]}
    for spec in KINDS[kind][1]:
        fig = Figure(figsize=(7.0, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        rows_per_file = [res[sections[spec.section].field] for res in results]
        xs = [r.get(spec.x) for rows in rows_per_file for r in rows]
        numeric = all(isinstance(x, int | float) for x in xs)
        colors = [f"C{i % 10}" for i in range(len(results))]
        styles = ["-", "--", ":", "-."]
        if numeric:
            groups = sorted({r.get(spec.group) for rows in rows_per_file for r in rows}, key=_order)
            style = {g: styles[i % len(styles)] for i, g in enumerate(groups if spec.group else [None])}
            for label, color, rows in zip(labels, colors, rows_per_file, strict=True):
                mine_groups = [g for g in style if any(r.get(spec.group) == g for r in rows)]
                for group in mine_groups if spec.group else [None]:
                    mine = sorted((r for r in rows if r.get(spec.group) == group), key=lambda r: r[spec.x])
                    mine = [r for r in mine if isinstance(r.get(spec.y), int | float)]
                    ax.plot(
                        [r[spec.x] for r in mine],
                        [spec.scale * r[spec.y] for r in mine],
                        marker="o",
                        color=color,
                        linestyle=style[group],
                        label=label if group is None else f"{label}, {spec.group} {group}",
                    )
            if spec.logx:
                ax.set_xscale("log", base=2)
                ticks = sorted({x for x in xs})
                ax.set_xticks(ticks, [str(t) for t in ticks])
        else:
            cats = list(dict.fromkeys(str(x) for x in xs))
            width = 0.8 / len(results)
            for fi, (label, color, rows) in enumerate(zip(labels, colors, rows_per_file, strict=True)):
                by = {str(r.get(spec.x)): r.get(spec.y) for r in rows}
                pos = [ci + (fi - (len(results) - 1) / 2) * width for ci in range(len(cats))]
                vals = [spec.scale * by[c] if isinstance(by.get(c), int | float) else 0.0 for c in cats]
                ax.bar(pos, vals, width=width, color=color, label=label)
            ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
        if ys and max(ys) > 30 * min(ys):  # results orders of magnitude apart: a log axis shows them all
            ax.set_yscale("log")
        ax.set_title(spec.title)
        ax.set_xlabel(spec.xlabel)
        ax.set_ylabel(spec.ylabel + (", log scale" if ax.get_yscale() == "log" else ""))
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        figures[spec.name] = fig
    return figures


def run(args: argparse.Namespace) -> int:
    """Print the side-by-side table of the result files and write their plots to --out-dir."""
    try:
        kind, results = read_results(args.files)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    labels = labels_for(args.files, results)
    print(f"bench {kind}: {len(results)} result(s)")
    for i, label, path in zip(string.ascii_uppercase, labels, args.files, strict=False):
        print(f"  {i} = {label}  [{path}]")
    for section in KINDS[kind][0]:
        rows, columns = table_rows(section, results)
        print(f"\n{section.field}:" if section.field != "rows" else "")
        print_table(rows, columns)
    if args.out_dir:
        out = Path(args.out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"error: cannot create --out-dir {out}: {exc}", file=sys.stderr)
            return 2
        for name, fig in build_figures(kind, results, labels).items():
            path = out / f"{kind}_{name}.png"
            fig.savefig(path, dpi=100)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="several bench results of one kind side by side: one table, PNG plots",
        description=__doc__,
    )
    p.add_argument("files", nargs="+", metavar="RESULT.json", help="results of `jaxhybrid bench KIND --out`")
    p.add_argument("--out-dir", default=None, help="write the PNG plots here (default: table only)")
    p.set_defaults(func=run)

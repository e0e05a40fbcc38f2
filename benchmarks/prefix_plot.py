"""The plot of `bench prefix --plot PATH.png` (matplotlib, Agg): one panel per workload family, the prompt
tokens computed (past each request's hit) against peak checkpoint bytes, a marker series per policy family
(fixed interval only, fixed with prompt/sequence ends, adaptive), each point labelled with its interval; the
lower bound (a checkpoint at every token, unlimited memory) and the store off as horizontal lines."""

from __future__ import annotations

from typing import Any

MARKERS = {"fixed interval": "o", "fixed + ends": "s", "adaptive": "D"}


def build_figure(rows: list[dict[str, Any]], families: list[str]) -> Any:
    """A matplotlib Figure (Agg canvas) of the rows, a panel per family."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * len(families), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(families), squeeze=False)[0]
    for ax, family in zip(axes, families, strict=True):
        mine = [r for r in rows if r["workload"] == family]
        series = dict.fromkeys(r["policy"] for r in mine if r["policy"] != "off")
        for i, policy in enumerate(series):
            points = [r for r in mine if r["policy"] == policy]
            xs = [r["peak_checkpoint_total_bytes"] for r in points]
            ys = [r["prompt_tokens_computed"] for r in points]
            marker = MARKERS.get(policy.split(" (")[0], "^")
            ax.plot(xs, ys, marker=marker, linestyle="", color=f"C{i % 10}", label=policy, alpha=0.8)
            labels: dict[tuple[int, int], list[str]] = {}  # budgets that change nothing share a point
            for r, x, y in zip(points, xs, ys, strict=True):
                at = labels.setdefault((x, y), [])
                if str(r["interval"]) not in at:
                    at.append(str(r["interval"]))
            for (x, y), text in labels.items():
                ax.annotate("/".join(text), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        bound = min(r["lower_bound_tokens"] for r in mine)
        ax.axhline(bound, color="black", linestyle="-", linewidth=1.0, label=f"lower bound ({bound:,})")
        for r in mine:
            if r["policy"] == "off":
                ax.axhline(
                    r["prompt_tokens_computed"], color="grey", linestyle="--", linewidth=1.0, label="off"
                )
        positive = [r["peak_checkpoint_total_bytes"] for r in mine if r["peak_checkpoint_total_bytes"] > 0]
        if positive:  # bytes span orders of magnitude; a setting that kept nothing stays at 0
            ax.set_xscale("symlog", linthresh=min(positive))
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{family}: prefill work vs checkpoint memory")
        ax.set_xlabel("peak checkpoint bytes (device + host)")
        ax.set_ylabel("prompt tokens computed")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def write_plot(rows: list[dict[str, Any]], families: list[str], path: str) -> None:
    build_figure(rows, families).savefig(path, dpi=100)

"""Latency summaries of `jaxhybrid bench serve`: mean and percentiles of a list of seconds."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean, p50 / p90 / p99 (linear interpolation between order statistics, numpy's default) and max of
    `count` values; all None when there are none."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    def fields(self, name: str, scale: float = 1e3, unit: str = "ms") -> dict[str, float | None]:
        """`{name}_mean_{unit}`, `{name}_p50_{unit}`, ... with each value times `scale`."""
        out = {}
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES), "max"):
            value = getattr(self, stat)
            out[f"{name}_{stat}_{unit}"] = None if value is None else value * scale
        return out


def summarize(values: Sequence[float]) -> Summary:
    if len(values) == 0:
        return Summary(0, None, None, None, None, None)
    arr = np.asarray(values, np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
    return Summary(len(arr), float(arr.mean()), p50, p90, p99, float(arr.max()))

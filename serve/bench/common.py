"""What every benchmark records: the platform, and how results are written (JSON to stdout / --out)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax_version": jax.__version__,
        "host": platform.node(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median / min wall seconds of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return {"median_s": samples[len(samples) // 2], "min_s": samples[0], "repeats": repeats}


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the JSON result to --out (if given) and print it as one JSON line."""
    text = json.dumps(result)
    if getattr(args, "out", None):
        Path(args.out).write_text(text + "\n")
    print(text)


def add_out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="also write the JSON result to this file")

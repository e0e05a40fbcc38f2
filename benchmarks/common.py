"""What several research benchmarks share: where the checkpoint is (children they start import
`benchmarks` from it), and the progress of a long replay."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the source checkout `benchmarks/` is in


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child `python -m benchmarks.X`: this one, `extra`, and the checkout first on
    PYTHONPATH (so the child finds `benchmarks` from whatever directory it starts in)."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, **extra, "PYTHONPATH": path}


class RoundProgress:
    """`replay`'s progress for a long run, on stderr: a line per round once `after_s` seconds have gone by
    (short runs stay quiet; stdout keeps the JSON)."""

    def __init__(self, label: str, rounds: int | None = None, after_s: float = 10.0):
        self.label, self.rounds, self.after_s = label, rounds, after_s
        self.t0 = time.perf_counter()

    def __call__(self, done: int, requests: int) -> None:
        elapsed = time.perf_counter() - self.t0
        if elapsed >= self.after_s:
            of = f" of {self.rounds}" if self.rounds else ""
            print(
                f"  {self.label}: round {done}{of} served ({requests:,} requests, {elapsed:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

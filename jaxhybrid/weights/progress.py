"""Progress of a checkpoint load: a bar on a terminal (tqdm), log lines otherwise, nothing for a quick one.

    with load_progress(total_bytes, "loading model", progress=None) as bar:
        bar.update(nbytes)  # after each tensor

`progress`: True a bar, False nothing, None a bar when stderr is a terminal and log lines when not (a server's
log, a CI job). Either appears only once the load has taken `delay_s` seconds; the log lines come every
`every_s` seconds from a timer thread, so a load that makes no `update` for a while (one Orbax restore call)
still says it is alive.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger("jaxhybrid.weights")

DELAY_S = 3.0  # a load quicker than this shows nothing
EVERY_S = 5.0  # seconds between log lines


class LogProgress:
    """tqdm's `update` / `set_postfix_str` / context-manager surface, reported as log lines."""

    def __init__(self, total: int, desc: str, delay_s: float | None = None, every_s: float | None = None):
        self.total, self.desc = total, desc
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self.every_s = EVERY_S if every_s is None else every_s
        self.n, self.postfix = 0, ""
        self._start = time.monotonic()
        self._logged = False
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._run, name="load-progress", daemon=True)

    def __enter__(self) -> LogProgress:
        self._timer.start()
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self._stop.set()
        self._timer.join()
        if self._logged and exc_type is None:
            log.info("%s: done, %s in %.1f s", self.desc, _mib(self.total), time.monotonic() - self._start)

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def _run(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        while True:
            self._logged = True
            log.info("%s", self.line())
            if self._stop.wait(self.every_s):
                return

    def line(self) -> str:
        """The progress so far in words."""
        elapsed = time.monotonic() - self._start
        done = "in progress"
        if self.total:
            done = f"{100 * self.n / self.total:.0f}% ({_mib(self.n)} of {_mib(self.total)})"
        extra = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}{extra}, {elapsed:.0f} s"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def load_progress(total: int, desc: str, progress: bool | None, stepwise: bool = True) -> Any:
    """A progress reporter for a load of `total` bytes (see the module doc). `stepwise=False`: the bytes
    arrive in one call (an Orbax restore), where a bar would have nothing to show: log lines instead."""
    from tqdm.auto import tqdm

    if progress is False:
        return tqdm(total=total, disable=True)
    if not stepwise or (progress is None and not sys.stderr.isatty()):
        return LogProgress(total, desc)
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        delay=DELAY_S,
        leave=False,
    )

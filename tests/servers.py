"""Servers for tests: the app under uvicorn in a thread, and `jaxhybrid serve` processes waited on until
healthy (shared by the server, hostile-input, soak and multi-process tests)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx

from serve.http.threaded import free_port as free_port  # re-exported for the tests
from serve.http.threaded import serving


def uvicorn_thread(
    app: Any, log_level: str = "warning", start_timeout: float = 30, port: int | None = None
) -> contextlib.AbstractContextManager[str]:
    """`app` served on localhost from a thread (on a free port unless `port`); its URL (`serving`)."""
    return serving(app, port, log_level, start_timeout)


def wait_healthy(url: str, alive: Callable[[], bool], describe: Callable[[], str], timeout: float) -> None:
    """Poll `url`/health until it answers 200; fail with `describe()` if a process died or time ran out."""
    deadline = time.monotonic() + timeout
    while True:
        assert alive(), describe()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.25)

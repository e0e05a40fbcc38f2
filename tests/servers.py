"""Servers for tests: the app under uvicorn in a thread, and `jaxhybrid serve` processes waited on until
healthy (shared by the server, hostile-input, soak and multi-process tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_thread(
    app: Any, log_level: str = "warning", start_timeout: float = 30, port: int | None = None
) -> Iterator[str]:
    """`app` served on localhost from a thread (on a free port unless `port`); yields its URL, stops it
    afterwards."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


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

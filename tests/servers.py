"""Servers for tests: the app under uvicorn in a thread, and `jaxhybrid serve` processes waited on until
healthy (shared by the server, hostile-input, soak and multi-process tests)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


class ServeProcess:
    """`jaxhybrid serve FLAGS` as a subprocess on a free port, its output in `log`, waited on until healthy
    (killed if it never is). `stop()` ends it with SIGTERM (-9 after 60 s) and returns its exit code;
    `kill()` is kill -9."""

    def __init__(self, log: Path, *flags: str, env: dict[str, str] | None = None, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "serve.cli", "serve", "--port", str(self.port), *flags]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, lambda: self.proc.poll() is None, self.tail, timeout=timeout)
        except BaseException:
            self.kill()
            raise

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_warm(self, timeout: float = 300) -> None:
        """Until the warm-up (`--warmup` other than none) has compiled everything: /health says "ok"."""
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health", timeout=30).json().get("status") != "ok":
            assert time.monotonic() < deadline and self.proc.poll() is None, self.tail()
            time.sleep(0.25)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

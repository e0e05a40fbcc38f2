"""What the first and the second start of `jaxhybrid serve` cost a new user (issue 27 item 7).

Starts `jaxhybrid serve` (the shipped model, no model arguments) as a subprocess `--starts` times, all with
one fresh, empty cache directory (XDG_CACHE_HOME, so the default compilation cache lands there), and for
each start measures, from the moment the process is launched: when `/health` first answers, when the
README's first curl (sent as soon as /health answers) completes and how long that request itself took, and
when /health says "ok" (warm-up done), with the warm-up's programs compiled. The first start compiles
everything; later ones read the persistent compilation cache. Prints JSON and a table.

    python -m benchmarks first-start
    python -m benchmarks first-start --server-args "--compile-cache off"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from serve.report import print_table

README_CURL = {"prompt": "Hello", "max_tokens": 16, "temperature": 0}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(server_args: list[str], env: dict, ok_timeout: float, log_path: str) -> dict:
    """Launch the server, send the README's curl as soon as /health answers, wait for status "ok"."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "serve.cli", "serve", "--port", str(port), *server_args]
    t0 = time.perf_counter()
    log = open(log_path, "w")  # noqa: SIM115  (closed below, after the process)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    out: dict = {}
    try:
        with httpx.Client(timeout=600) as client:
            while "health_s" not in out:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}); its log: {log_path}")
                try:
                    client.get(f"{url}/health", timeout=2)
                    out["health_s"] = time.perf_counter() - t0
                except httpx.TransportError:
                    time.sleep(0.05)
            sent = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json=README_CURL)
            r.raise_for_status()
            done = time.perf_counter()
            out["first_completion_s"] = done - t0
            out["first_request_s"] = done - sent
            out["first_text"] = r.json()["choices"][0]["text"]
            while True:
                body = client.get(f"{url}/health").json()
                if body.get("status") == "ok":
                    out["ok_s"] = time.perf_counter() - t0
                    break
                if time.perf_counter() - t0 > ok_timeout:
                    out["ok_s"] = None
                    break
                time.sleep(0.2)
            warm = body.get("warmup", {})
            out["warmup_state"] = warm.get("state")
            out["warmup_compiled"] = f"{warm.get('compiled')}/{warm.get('total')}"
            out["warmup_s"] = warm.get("elapsed_s")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return out


def main() -> None:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=2, help="starts on one cache directory (default 2)")
    p.add_argument("--server-args", default="", help="extra `jaxhybrid serve` arguments, one string")
    p.add_argument("--ok-timeout", type=float, default=900.0, help="seconds to wait for status ok")
    p.add_argument("--logs", default=None, help="keep each start's server log here (default: a temp dir)")
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="first-start-") as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        logs = args.logs or cache
        os.makedirs(logs, exist_ok=True)
        for i in range(args.starts):
            log_path = os.path.join(logs, f"start{i + 1}.log")
            row = {"start": i + 1, **one_start(shlex.split(args.server_args), env, args.ok_timeout, log_path)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"server_args": args.server_args, "starts": rows}, indent=1))
    for row in rows:
        for k in ("health_s", "first_completion_s", "first_request_s", "ok_s"):
            row[k] = "-" if row.get(k) is None else f"{row[k]:.1f}"
    print_table(
        rows,
        ["start", "health_s", "first_request_s", "first_completion_s", "ok_s", "warmup_compiled", "warmup_s"],
    )


if __name__ == "__main__":
    main()

"""Every run after the first: commands and servers started one after another, each in a fresh process, sharing
one compile cache directory (as a user's commands share the default one) give exactly what they give without
a cache, and a server killed with kill -9 while it saves prefix-store checkpoints starts again and serves the
same tokens.

On XLA:CPU an executable that JAX's persistent cache gave back serializes without its kernels' code; the
engine's own layer of serialized executables (`serve.engine.executables`) kept such a program, and the next
process that loaded it died at its first step ("Function select_bitcast_fusion not found"). The sequences
below are the ones that met it: `generate` with and without the prefix cache alternately (their programs
share JAX's entries but not the engine's), four times.

Oracle everywhere: the same command with `--compile-cache off` (or JAX's cache off), token for token."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import subprocess_xla_flags
from servers import ServeProcess

ROOT = Path(__file__).resolve().parent.parent
TINY = ("--config", "tiny", "--seed", "0")
ENGINE = ("--max-model-len", "64", "--prefill-chunk", "16", "--slots", "2")
PROMPTS = [list(range(1, 21)), list(range(1, 17)) + [99, 98, 97]]  # two prompts sharing a prefix


def env_for(home: Path, **extra: str) -> dict[str, str]:
    """A command's environment: the user's cache directory at `home` (the kernels and the default compile
    cache live there), this run's XLA flags on one device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env |= {"XDG_CACHE_HOME": str(home), "XLA_FLAGS": subprocess_xla_flags(None), "PYTHONPATH": str(ROOT)}
    env |= {"JAX_DEFAULT_MATMUL_PRECISION": "highest", **extra}
    return env


def jaxhybrid(env: dict[str, str], *argv: str, timeout: float = 600) -> str:
    """`jaxhybrid ARGV` in a fresh process: its stdout; it must end well, without a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "serve.cli", *argv], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def generated(env: dict[str, str], prompts_file: Path, *flags: str) -> list[list[int]]:
    out = jaxhybrid(env, "generate", *TINY, *ENGINE, "--prompts-file", str(prompts_file), "--json", *flags)
    return [json.loads(line)["token_ids"] for line in out.strip().splitlines()]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return f


def test_generate_runs_sharing_a_compile_cache_give_the_uncached_tokens(tmp_path, prompts_file):
    """Four `generate` runs, with and without the prefix cache alternately, in fresh processes sharing one
    cache directory: each gives the tokens of a run without a cache (the fourth died before the fix)."""
    sampling = ("--max-tokens", "12", "--temperature", "0")
    want = generated(env_for(tmp_path / "off"), prompts_file, *sampling, "--compile-cache", "off")
    env, cache = env_for(tmp_path / "home"), str(tmp_path / "cache")
    for i, flags in enumerate([("--no-prefix-cache",), (), ("--no-prefix-cache",), ()]):
        got = generated(env, prompts_file, *sampling, "--compile-cache", cache, *flags)
        assert got == want, (i, flags)
    assert list((tmp_path / "cache" / "executables").glob("*.pkl"))  # the engine's layer was in use


class Server(ServeProcess):
    """`jaxhybrid serve` of tiny with the tests' engine flags (`ServeProcess`), greedy completions."""

    def __init__(self, env: dict[str, str], log: Path, *flags: str):
        super().__init__(log, *TINY, *ENGINE, *flags, env=env)

    def complete(self, prompt: list[int], n: int) -> list[int]:
        body = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, (r.text, self.tail())
        return r.json()["choices"][0]["token_ids"]


def test_serve_restarts_sharing_a_compile_cache_answer_as_uncached(tmp_path):
    """`serve` started three times on one cache directory, each answering a completion; before the second
    start the engine's executables are removed, so that it compiles what JAX's cache holds (and, before the
    fix, kept it broken for the third). Oracle: the first start's tokens, on an empty cache (nothing read)."""
    env, cache = env_for(tmp_path / "home"), tmp_path / "cache"
    got = []
    for i in range(3):
        if i == 1:
            shutil.rmtree(cache / "executables")
        server = Server(env, tmp_path / f"serve{i}.log", "--compile-cache", str(cache), "--warmup", "decode")
        try:
            got.append([server.complete(p, 8) for p in PROMPTS])
            server.wait_warm()  # the programs compiled in the background are kept by now
        finally:
            server.stop()
        log = server.log.read_text()
        assert "Traceback" not in log, server.tail()
        # every entry loads: the native kernels' handlers are registered before (a restart logged "No FFI
        # handler registered for jaxhybrid_matvec_f32" and compiled that program again at every start)
        assert "cannot load the compiled program" not in log, server.tail()
    assert got[1] == got[0] and got[2] == got[0]


def test_kill_9_during_prefix_store_saves_then_restart_ten_times(tmp_path):
    """A server with a disk tier is killed with -9 while it saves checkpoints, ten times, on one compile
    cache: every restart comes up and answers the prompts whose checkpoints earlier rounds kept with the
    tokens of a server without a prefix store."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    env, cache = env_for(tmp_path / "home"), str(tmp_path / "cache")
    ref = Server(
        env, tmp_path / "ref.log", "--no-prefix-cache", "--compile-cache", cache, "--warmup", "decode"
    )
    try:
        want = [ref.complete(p, 4) for p in prompts]
        ref.wait_warm()
    finally:
        ref.stop()
    shutil.rmtree(tmp_path / "cache" / "executables")  # the first round compiles what JAX's cache holds
    flags = ("--store-dir", str(tmp_path / "store"), "--checkpoint-interval", "16", "--warmup", "decode")
    for round_ in range(10):
        server = Server(env, tmp_path / f"round{round_}.log", *flags, "--compile-cache", cache)
        try:
            assert [server.complete(p, 4) for p in prompts] == want, round_
            server.wait_warm()
            # a new prompt: its checkpoints are being saved when the kill lands
            server.complete([rng.randrange(3, 500) for _ in range(rng.randint(17, 40))], 1)
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            server.kill()
        assert "Traceback" not in server.log.read_text(), server.tail()

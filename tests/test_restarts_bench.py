"""Benchmarks run one after another, each in a fresh process, sharing one compile cache directory (as a
user's commands share it), report what they computed on an empty cache: `tests/test_restarts.py` has the
story and the commands and servers. Both benchmarks are research ones (`benchmarks/`): `-m lab` runs
these."""

from __future__ import annotations

import json
import shutil

import pytest
from test_restarts import TINY, env_for, jaxhybrid


def bench_rows(env: dict[str, str], keep: tuple[str, ...], *argv: str) -> list[dict]:
    """`jaxhybrid bench ...` rows (its JSON, stdout's last line), the fields `keep` of each: what it
    computed, not what it timed (nor what timings decide: the step gate drafts while drafting pays)."""
    rows = json.loads(jaxhybrid(env, "bench", *argv).strip().splitlines()[-1])["rows"]
    assert rows
    return [{k: r[k] for k in keep} for r in rows]


PREFIX_KEEP = (
    "workload",
    "setting",
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "recomputed_tokens",
    "prompt_tokens_computed",
    "peak_checkpoint_bytes",
    "hits",
)
SPECULATIVE_KEEP = ("workload", "method", "requests", "prompt_tokens", "identical", "copied")


@pytest.mark.parametrize(
    "keep, argv",
    [
        pytest.param(
            PREFIX_KEEP,
            (
                "prefix",
                *TINY[:2],
                "--workload",
                "chat",
                "--conversations",
                "2",
                "--turns",
                "2",
                "--intervals",
                "16",
                "--checkpoint-policy",
                "fixed",
                "--max-tokens",
                "4",
            ),
            id="prefix",
            marks=pytest.mark.lab,
        ),
        pytest.param(
            SPECULATIVE_KEEP,
            (
                "speculative",
                *TINY[:2],
                "--workloads",
                "edit",
                "--new-tokens",
                "8",
                "--repeats",
                "1",
                "--prompt-chars",
                "200",
                "--draft-model",
                "self",
            ),
            id="speculative",
            marks=pytest.mark.lab,
        ),
    ],
)
def test_benches_sharing_a_compile_cache_report_as_uncached(tmp_path, keep, argv):
    """A bench run three times on one cache directory ($JAX_COMPILATION_CACHE_DIR, as a user sets it), the
    engine's executables removed before the second run (as in the `serve` test): each reports the tokens and
    hits of the first run, on an empty cache."""
    cache = tmp_path / "cache"  # every program kept, however quick to compile, as `--compile-cache` does
    env = env_for(tmp_path / "home", JAX_COMPILATION_CACHE_DIR=str(cache))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    want = bench_rows(env, keep, *argv)
    shutil.rmtree(cache / "executables")
    for i in range(2):
        assert bench_rows(env, keep, *argv) == want, i

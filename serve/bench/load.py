"""`jaxhybrid bench load --model DIR`: peak resident memory and wall time of `load_pretrained`.

Each load runs in a fresh Python process (so nothing else inflates its peak RSS), which reports its own
`ru_maxrss`. The target: on the CPU, where device arrays live in host memory, loading a checkpoint of N
bytes peaks under 1.25 x N + 300 MiB (one copy of the weights plus the runtime, never a second copy).
`--make CONFIG` first writes a random-weight HF checkpoint of that config into DIR (in another process);
`--orbax-dir` also converts DIR there and measures loading that.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from serve.bench.common import add_out_arg, emit, environment
from serve.report import DTYPES, fmt_bytes, print_table

SLACK_BYTES = 300 * 2**20
FACTOR = 1.25


def dir_bytes(directory: Path) -> int:
    """Bytes of the checkpoint data: the safetensors files, or everything under an Orbax params/."""
    from jaxhybrid.weights import checkpoint_format

    if checkpoint_format(directory) == "hf":
        files = list(directory.glob("*.safetensors"))
    else:
        files = [p for p in (directory / "params").rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now; VmHWM: peak resident) in bytes.

    VmHWM, not `ru_maxrss`: on Linux, exec carries the parent's peak into the child's ru_maxrss, so a child
    started from a big process (a test run) would report the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_load(directory: str, dtype: str) -> dict:
    """Runs in the fresh process: import everything, note the baseline, load, report the peak."""
    import time

    import jax
    import numpy as np
    from flax import nnx

    from jaxhybrid.weights import checkpoint_format, load_pretrained

    jax.devices()
    baseline = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = load_pretrained(directory, dtype=None if dtype == "auto" else dtype, progress=False)
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    load_s = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    return {
        "format": checkpoint_format(directory),
        "load_s": load_s,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "rss_after_bytes": _status_bytes("VmRSS"),
        "model_bytes": int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)),
        "arrays": len(leaves),
    }


def child_make(config: str, directory: str, dtype: str, shard_mb: float, seed: int) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM
    from jaxhybrid.weights import save_hf

    model = HybridLM(load_config(config), rngs=nnx.Rngs(seed), dtype=jnp.dtype(dtype))
    files = save_hf(model, directory, max_shard_bytes=int(shard_mb * 2**20))
    return {"files": len(files)}


def _in_child(argv: list[str]) -> dict:
    """Run `python -m serve.bench.load ARGV` and return the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, "-m", "serve.bench.load", *argv], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {' '.join(argv[:2])} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(directory: Path, dtype: str, repeats: int) -> dict:
    runs = [_in_child(["--child-load", str(directory), dtype]) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["load_s"])
    n = dir_bytes(directory)
    limit = int(FACTOR * n + SLACK_BYTES)
    peak = max(r["peak_rss_bytes"] for r in runs)
    return {
        **best,
        "model": str(directory),
        "checkpoint_bytes": n,
        "peak_rss_bytes": peak,
        "peak_over_baseline_bytes": peak - best["baseline_rss_bytes"],
        "peak_over_checkpoint": peak / n,
        "limit_bytes": limit,
        "within_limit": peak < limit,
        "load_s_all": [r["load_s"] for r in runs],
    }


def run(args: argparse.Namespace) -> int:
    """Peak RSS and time of loading a checkpoint directory (HF safetensors or our Orbax), each in a fresh
    process."""
    model_dir = Path(args.model)
    if args.make and not (model_dir / "config.json").exists():
        made = _in_child(
            ["--child-make", args.make, str(model_dir), args.make_dtype, str(args.shard_mb), str(args.seed)]
        )
        print(
            f"wrote a random {args.make} checkpoint to {model_dir} ({made['files']} files)", file=sys.stderr
        )
    if not (model_dir / "config.json").exists():
        print(f"error: {model_dir}: no config.json (give --make CONFIG to write one)", file=sys.stderr)
        return 2
    rows = [measure(model_dir, args.dtype, args.repeats)]
    if args.orbax_dir:
        from jaxhybrid.weights import load_pretrained, save_orbax

        orbax_dir = Path(args.orbax_dir)
        if not (orbax_dir / "config.json").exists():  # what `jaxhybrid convert` does
            save_orbax(load_pretrained(model_dir, progress=False), orbax_dir, tokenizer_dir=model_dir)
        rows.append(measure(orbax_dir, args.dtype, args.repeats))
    result = {"bench": "load", "dtype": args.dtype, "environment": environment(), "rows": rows}
    print_table(
        [
            {
                "format": r["format"],
                "checkpoint": fmt_bytes(r["checkpoint_bytes"]),
                "load_s": f"{r['load_s']:.2f}",
                "baseline_rss": fmt_bytes(r["baseline_rss_bytes"]),
                "peak_rss": fmt_bytes(r["peak_rss_bytes"]),
                "peak/N": f"{r['peak_over_checkpoint']:.3f}",
                "limit": fmt_bytes(r["limit_bytes"]),
                "ok": "yes" if r["within_limit"] else "NO",
            }
            for r in rows
        ],
        ["format", "checkpoint", "load_s", "baseline_rss", "peak_rss", "peak/N", "limit", "ok"],
        file=sys.stderr,
    )
    emit(result, args)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="peak RSS and time of loading a checkpoint", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (HF safetensors or converted Orbax)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="model dtype (default: stored)")
    p.add_argument("--repeats", type=int, default=1, help="loads, each in a fresh process (default 1)")
    p.add_argument(
        "--make", metavar="CONFIG", help="first write a random-weight checkpoint of CONFIG to --model"
    )
    p.add_argument(
        "--make-dtype", choices=DTYPES, default="bfloat16", help="dtype of --make (default bfloat16)"
    )
    p.add_argument("--shard-mb", type=float, default=256, help="shard size of --make in MiB (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of --make's random weights")
    p.add_argument("--orbax-dir", help="also convert --model to this Orbax directory and measure loading it")
    add_out_arg(p)
    p.set_defaults(func=run)


if __name__ == "__main__":
    if sys.argv[1] == "--child-load":
        out = child_load(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--child-make":
        out = child_make(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit("usage: python -m serve.bench.load --child-load DIR DTYPE | --child-make ...")
    print(json.dumps(out))

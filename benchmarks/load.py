"""`jaxhybrid bench load --model DIR`: peak resident memory and wall time of `load_pretrained`.

Each load runs in a fresh Python process (so nothing else inflates its peak RSS), which reports its own
`ru_maxrss`. The target: on the CPU, where device arrays live in host memory, loading a checkpoint of N
bytes peaks under 1.25 x N + 300 MiB (one copy of the weights plus the runtime, never a second copy).
`--make CONFIG` first writes a random-weight HF checkpoint of that config into DIR (in another process);
`--orbax-dir` also converts DIR there and measures loading that.

`--mesh SPEC --processes N` adds a row per format: N fresh processes (each with `--local-devices` CPU
devices, joined over gloo on localhost) load the checkpoint straight into their shards on the mesh, each
reporting its own peak RSS and the bytes it read (`/proc/self/io` rchar, and the loader's own count for
safetensors), against one process loading it whole.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import child_env
from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights import checkpoint_format, load_pretrained, save_hf, save_orbax
from serve.bench.common import add_out_arg, environment
from serve.report import DTYPES, fmt_bytes
from sharding import multihost
from sharding.mesh import mesh_from_flag
from sharding.placement import load_pretrained_on_mesh

SLACK_BYTES = 300 * 2**20
FACTOR = 1.25


def dir_bytes(directory: Path) -> int:
    """Bytes of the checkpoint data: the safetensors files, or everything under an Orbax params/."""
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


def _io_read_bytes() -> int:
    """Bytes this process has read through read/pread system calls so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def child_load(directory: str, dtype: str, mesh_spec: str | None = None) -> dict:
    """Runs in the fresh process (already in its process group with `mesh_spec`): import everything, note
    the baseline, load (into the mesh's shardings with a mesh), report the peak and the bytes read."""
    import time

    import jax
    import numpy as np
    from flax import nnx

    jax.devices()
    mesh = None
    if mesh_spec:
        mesh = mesh_from_flag(mesh_spec)
    baseline = _status_bytes("VmRSS")
    rchar = _io_read_bytes()
    report: dict = {}
    t0 = time.perf_counter()
    want = None if dtype == "auto" else dtype
    if mesh is None:
        model = load_pretrained(directory, dtype=want, progress=False, report=report)
    else:
        model = load_pretrained_on_mesh(directory, mesh, want, progress=False, report=report)
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    load_s = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    local = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    return {
        "format": checkpoint_format(directory),
        "mesh": mesh_spec,
        "process": jax.process_index(),
        "load_s": load_s,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "rss_after_bytes": _status_bytes("VmRSS"),
        "model_bytes": int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)),
        "local_shard_bytes": int(local),
        "io_read_bytes": _io_read_bytes() - rchar,
        "loader_read_bytes": report.get("read_bytes"),
        "arrays": len(leaves),
    }


def child_make(config: str, directory: str, dtype: str, shard_mb: float, seed: int) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    model = HybridLM(load_config(config), rngs=nnx.Rngs(seed), dtype=jnp.dtype(dtype))
    files = save_hf(model, directory, max_shard_bytes=int(shard_mb * 2**20))
    return {"files": len(files)}


def _in_child(argv: list[str]) -> dict:
    """Run `python -m benchmarks.load ARGV` and return the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", *argv],
        capture_output=True,
        text=True,
        check=False,
        env=child_env(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {' '.join(argv[:2])} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_processes(argv: list[str], processes: int, local_devices: int) -> list[dict]:
    """`python -m benchmarks.load ARGV` in `processes` processes of one group (gloo on localhost), each
    with `local_devices` CPU devices; the JSON each prints last, in process order."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.load", *argv, f"127.0.0.1:{port}", str(processes), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"child {' '.join(argv[:2])} failed:\n{err[-4000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def measure(
    directory: Path,
    dtype: str,
    repeats: int,
    mesh: str | None = None,
    processes: int = 1,
    local_devices: int = 1,
) -> dict:
    """One checkpoint's load: whole in one process, or with `mesh` in `processes` processes at once (the
    figures of the process with the highest peak; `per_process` holds all)."""
    if mesh is None:
        runs = [_in_child(["--child-load", str(directory), dtype]) for _ in range(repeats)]
        per_process = None
    else:
        groups = [
            _in_processes(["--child-load-mesh", str(directory), dtype, mesh], processes, local_devices)
            for _ in range(repeats)
        ]
        runs = [max(g, key=lambda r: r["peak_rss_bytes"]) for g in groups]
        per_process = min(groups, key=lambda g: max(r["load_s"] for r in g))
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
        "processes": processes if mesh else 1,
        "per_process": per_process,
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
    dirs = [model_dir]
    if args.orbax_dir:
        orbax_dir = Path(args.orbax_dir)
        if not (orbax_dir / "config.json").exists():  # what `jaxhybrid convert` does
            save_orbax(load_pretrained(model_dir, progress=False), orbax_dir, tokenizer_dir=model_dir)
        dirs.append(orbax_dir)
    rows = []
    for directory in dirs:
        rows.append(measure(directory, args.dtype, args.repeats))
        if args.mesh:
            rows.append(
                measure(directory, args.dtype, args.repeats, args.mesh, args.processes, args.local_devices)
            )
    result = {"bench": "load", "dtype": args.dtype, "environment": environment(), "rows": rows}
    # table column -> the row's field (bytes shown as sizes)
    sizes = {
        "checkpoint": "checkpoint_bytes",
        "baseline_rss": "baseline_rss_bytes",
        "peak_rss": "peak_rss_bytes",
        "peak-baseline": "peak_over_baseline_bytes",
        "local_shards": "local_shard_bytes",
        "read": "io_read_bytes",
    }
    table = Table(
        [
            {
                **r,
                **{column: r[field] for column, field in sizes.items()},
                "peak/N": r["peak_over_checkpoint"],
                "ok": "yes" if r["within_limit"] else "NO",
            }
            for r in rows
        ],
        ["format", "mesh", "processes", *list(sizes)[:1], "load_s", *list(sizes)[1:], "peak/N", "ok"],
        {"mesh": lambda m: m or "-", "load_s": ".2f", "peak/N": ".3f", **dict.fromkeys(sizes, fmt_bytes)},
    )
    return report(result, args, table)


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
    p.add_argument(
        "--mesh",
        help="also load straight into this mesh's shardings (e.g. expert=8) in --processes processes at "
        "once, each reporting its own peak RSS and bytes read",
    )
    p.add_argument("--processes", type=int, default=2, help="processes of the --mesh load (default 2)")
    p.add_argument(
        "--local-devices",
        type=int,
        default=4,
        help="simulated CPU devices per process of the --mesh load (default 4; processes x this = mesh size)",
    )
    add_out_arg(p)
    p.set_defaults(func=run)


if __name__ == "__main__":
    if sys.argv[1] == "--child-load":
        out = child_load(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--child-load-mesh":  # DIR DTYPE MESH COORDINATOR NUM_PROCESSES PROCESS_ID
        multihost.initialize(multihost.MultihostSettings(sys.argv[5], int(sys.argv[6]), int(sys.argv[7])))
        out = child_load(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "--child-make":
        out = child_make(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit("usage: python -m benchmarks.load --child-load DIR DTYPE | --child-make ...")
    print(json.dumps(out))

"""`jaxhybrid bench mesh`: per-device parameter bytes and decode tokens/s for several mesh shapes.

Simulate devices on a CPU with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before start).
Each mesh shards the same model (`sharding.placement.shard_model`, expert parallelism where the expert axis
divides the experts), builds an engine on it, and times its decode step over all slots at `--context`.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.bench.common import add_out_arg, decode_step, environment
from serve.engine.engine import Engine, EngineConfig
from sharding.mesh import describe, mesh_from_flag
from sharding.placement import shard_model


def run(args: argparse.Namespace) -> int:
    """Per-device parameter bytes and decode tokens/s per mesh shape."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    cfg = load_config(args.config)
    specs = [s.strip() for s in args.meshes.split(";") if s.strip()]
    rows = []
    for spec in specs:
        single = all(part.split("=")[-1].strip() == "1" for part in spec.split(","))
        mesh = None if single else mesh_from_flag(spec)
        model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
        if mesh is not None:
            shard_model(model, mesh)
        devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        total = sum(x.nbytes for x in leaves)
        per_device = max(
            sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == d) for d in devices
        )
        blocks = math.ceil((args.context + 1) / args.block_size)
        engine = Engine(
            model,
            EngineConfig(
                max_slots=args.slots,
                block_size=args.block_size,
                max_model_len=args.context + args.block_size,
                num_blocks=args.slots * blocks + 1,
                kv_dtype=args.dtype,
            ),
            mesh=mesh,
        )
        step = decode_step(engine, args.slots, args.context, blocks)
        for _ in range(3):
            step()
        samples = [step() for _ in range(args.repeats)]
        med = float(np.median(samples))
        rows.append(
            {
                "mesh": "single device" if mesh is None else describe(mesh),
                "devices": len(devices),
                "param_bytes": total,
                "param_bytes_per_device": per_device,
                "per_device_fraction": per_device / total,
                "step_ms": 1e3 * med,
                "decode_tokens_per_s": args.slots / med,
            }
        )
    result = {
        "bench": "mesh",
        "config": cfg.name,
        "slots": args.slots,
        "context": args.context,
        "dtype": args.dtype,
        "environment": environment(),
        "rows": rows,
    }
    columns = [
        "mesh",
        "devices",
        "param_bytes_per_device",
        "per_device_fraction",
        "step_ms",
        "decode_tokens_per_s",
    ]
    formats = {"per_device_fraction": ".3f", "step_ms": ".1f", "decode_tokens_per_s": ".1f"}
    return report(result, args, Table(rows, columns, formats))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mesh", help="per-device parameter bytes and decode tokens/s per mesh shape", description=__doc__
    )
    p.add_argument("--config", default="tiny", help="config name or path (default tiny)")
    p.add_argument(
        "--meshes",
        default="data=1,expert=1,tensor=1;data=1,expert=1,tensor=8;data=1,expert=8,tensor=1;"
        "data=2,expert=2,tensor=2;data=8,expert=1,tensor=1",
        help="';'-separated mesh specs (each must use every device, or 1 device: data=1,...=1)",
    )
    p.add_argument("--slots", type=int, default=8, help="decode batch (default 8)")
    p.add_argument("--context", type=int, default=1024, help="tokens in each sequence's cache (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per mesh (median reported)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    add_out_arg(p)
    p.set_defaults(func=run)

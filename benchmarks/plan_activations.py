"""The plan's activation estimate (`serve.plan.activation_bytes`) against the temporaries XLA reports for the
engine's compiled programs (`memory_analysis().temp_size_in_bytes`) on this backend: the longest prefill
program (one row of the chunk at full context) and the decode step of every slot.

    python -m benchmarks plan-activations --configs tiny-k3,small --context 1024 --chunk 256 --slots 4

Prints one JSON object, then a table."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.report import Table, report
from jaxhybrid.cache import SCRATCH_BLOCK
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.plan import activation_bytes
from sharding.plan import abstract_mesh


def measure(name: str, context: int, chunk: int, slots: int) -> dict:
    cfg = load_config(name)
    config = EngineConfig(
        max_slots=slots, prefill_chunk=chunk, max_model_len=context, prefix=None, scan_layers="off"
    )
    engine = Engine(HybridLM(cfg, rngs=nnx.Rngs(0)), config)
    runner, shape = engine.runner, engine.shape
    kda = tuple(p for k, p in zip(cfg.layer_types, runner.pools, strict=True) if k == "kda")
    mla = tuple(p for k, p in zip(cfg.layer_types, runner.pools, strict=True) if k != "kda")
    width = shape.table_buckets[-1]
    temps = {}
    for label, rows, length in (("prefill", 1, shape.bucket(min(chunk, context))), ("decode", slots, 1)):
        args = (
            jnp.zeros((rows, length), jnp.int32),
            jnp.arange(rows, dtype=jnp.int32),
            jnp.full((rows, width), SCRATCH_BLOCK, jnp.int32),
            jnp.zeros((rows,), jnp.int32),
            jnp.zeros((rows,), jnp.int32),
        )
        compiled = runner.programs.run.lower(runner.params, kda, mla, *args).compile()
        temps[label] = int(compiled.memory_analysis().temp_size_in_bytes)
    estimate = activation_bytes(cfg, abstract_mesh({}), shape, packed=False)
    return {
        "config": name,
        "context": context,
        "chunk": chunk,
        "slots": slots,
        "xla_prefill_temp_bytes": temps["prefill"],
        "xla_decode_temp_bytes": temps["decode"],
        "estimate_bytes": estimate,
        "xla_over_estimate": round(max(temps.values()) / estimate, 3),
        "backend": jax.default_backend(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny-k3,small")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    rows = [measure(n, args.context, args.chunk, args.slots) for n in args.configs.split(",")]
    report({"rows": rows}, args, Table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

"""What XLA compile options do to the engine's decode program, in one process.

The decode program of an engine (one slot, the cache filled to `--context`) is lowered once and compiled
twice: with XLA's defaults and with `--options` (JSON; default: the decode programs' own
`serve.engine.executables.DECODE_OPTIONS`, without XLA:CPU's XNNPACK fusions). The two are timed in
alternation, `--steps` steps each per round, so the machine's drift falls on both. Prints JSON and a table:
the median over rounds of each round's median step, and their ratio.

    python -m benchmarks decode-options --model /tmp/small --weight-dtype int8
    python -m benchmarks decode-options --config small
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights import load_pretrained
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.common import environment
from serve.engine.config import ProgramShape
from serve.engine.engine import Engine, EngineConfig
from serve.engine.executables import DECODE_OPTIONS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face checkpoint directory")
    src.add_argument("--config", default="small", help="random weights of this config (default small)")
    p.add_argument("--weight-dtype", choices=["int8"], help="hold the matrices as int8")
    p.add_argument("--options", help="XLA compile options as JSON (default: DECODE_OPTIONS)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    options = json.loads(args.options) if args.options else DECODE_OPTIONS
    if args.model:
        model = load_pretrained(args.model, dtype=jnp.float32, progress=None)
    else:
        model = HybridLM(load_config(args.config), rngs=nnx.Rngs(0), dtype=jnp.float32)
        move_to_huge_pages(model)  # as the server's loader does
    if args.weight_dtype == "int8":
        model.to_int8()
    block = 16
    blocks = -(-(args.context + 1) // block)
    config = EngineConfig(
        max_slots=1, block_size=block, max_model_len=blocks * block, num_blocks=blocks + 1, prefix=None
    )
    runner = Engine(model, config).runner
    program = ProgramShape(1, 1, runner.shape.table_width(blocks))
    _, fn, specs = runner.compiles._ahead_args(program)
    lowered = fn.lower(*specs)
    variants = {"default": lowered.compile(), "options": lowered.compile(compiler_options=options)}
    kda, mla = runner._split_pools()
    table = np.zeros((1, program.width), np.int32)
    table[0, :blocks] = 1 + np.arange(blocks)
    host = (np.array([[7]]), np.zeros(1), table, np.full(1, args.context), np.ones(1))
    inputs = [jnp.asarray(np.asarray(a, np.int32)) for a in host]
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds + 2):
        for name, compiled in variants.items():
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out, _, mla = compiled(runner.params, kda, mla, *inputs)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
            if r >= 2:  # two warm-up rounds
                rounds[name].append(float(np.median(times)))
    median = {name: float(np.median(v)) for name, v in rounds.items()}
    result = {
        "benchmark": "decode_options",
        "model": args.model or args.config,
        "weight_dtype": args.weight_dtype or "float32",
        "context": args.context,
        "options": options,
        "environment": environment(),
        "median_step_s": median,
        "rounds_s": rounds,
        "ratio_options_over_default": median["options"] / median["default"],
    }
    rows = [{"program": name, "step_ms": 1e3 * median[name]} for name in variants]
    ratio = f"options / default: {result['ratio_options_over_default']:.3f}"
    report(result, args, Table(rows, ["program", "step_ms"], {"step_ms": ".3f"}), ratio)


if __name__ == "__main__":
    main()

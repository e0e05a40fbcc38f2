"""`jaxhybrid bench decode`: per-step decode time against context length, for a config and its KDA-only twin.

The question: a KDA layer's decode cost is constant (fixed-size state), an MLA layer's grows with the
context it attends over. Each variant runs the engine's own decode program (all slots, paged latent KV)
with the cache filled to each context length; the ratio t(longest) / t(shortest) shows the growth.

`--compare-dequantized` (a config with MXFP4 experts): the variants are instead the model with its experts
kept packed and the same model with them dequantized, each row with the bytes the model holds and the bytes
one step reads (`bench throughput`'s count: the experts B rows are expected to choose, as stored); the
ratio of packed to dequantized tokens/s is printed.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, held_bytes
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.common import add_out_arg, decode_step, environment
from serve.engine.config import engine_default
from serve.engine.engine import Engine, EngineConfig
from serve.report import fmt_bytes
from serve.sim.cost import decode_bytes, param_bytes


def kda_only(cfg):
    """The same model with every layer KDA (no MLA, so no context-dependent decode work)."""
    return cfg.replace(
        name=f"{cfg.name}-kda-only",
        kda_layers=tuple(range(1, cfg.num_hidden_layers + 1)),
        full_attn_layers=(),
    )


def measure(
    cfg,
    contexts: list[int],
    batch: int,
    repeats: int,
    dtype: str,
    block_size: int,
    dequantize_experts: bool = False,
    variant: str | None = None,
) -> list[dict]:
    import jax.numpy as jnp
    from flax import nnx

    longest = max(contexts)
    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), dequantize_experts=dequantize_experts)
    move_to_huge_pages(model)  # as the server's loader does
    held, params = held_bytes(model), param_bytes(model)
    blocks_per_seq = math.ceil((longest + 1) / block_size)
    engine = Engine(
        model,
        EngineConfig(
            max_slots=batch,
            block_size=block_size,
            max_model_len=longest + block_size,
            num_blocks=batch * blocks_per_seq + 1,
            kv_dtype=dtype,
        ),
    )
    del model
    steps = {ctx: decode_step(engine, batch, ctx, blocks_per_seq) for ctx in contexts}

    for ctx in contexts:  # compile and warm every shape first
        for _ in range(3):
            steps[ctx]()
    samples: dict[int, list[float]] = {ctx: [] for ctx in contexts}
    for _ in range(repeats):  # interleaved, so load drift on a shared machine hits every context alike
        for ctx in contexts:
            samples[ctx].append(steps[ctx]())
    rows = []
    for ctx in contexts:
        med, low = float(np.median(samples[ctx])), min(samples[ctx])
        read = decode_bytes(cfg, params, batch, ctx, dtype)["bytes"]
        rows.append(
            {
                "variant": variant or cfg.name,
                "context": ctx,
                "batch": batch,
                "step_ms": 1e3 * med,
                "step_ms_min": 1e3 * low,
                "tokens_per_s": batch / med,
                "mla_layers": cfg.num_mla_layers,
                "kda_layers": cfg.num_kda_layers,
                "model_bytes": held,
                "bytes_per_step": read,
            }
        )
    return rows


def variants(cfg, compare_dequantized: bool) -> list[tuple[object, bool, str]]:
    """(config, dequantize_experts, name) of each measured variant."""
    if not compare_dequantized:
        return [(cfg, False, cfg.name), (kda_only(cfg), False, kda_only(cfg).name)]
    if cfg.expert_quant != "mxfp4":
        raise ValueError(f"--compare-dequantized needs a config with MXFP4 experts; {cfg.name} has none")
    return [(cfg, False, f"{cfg.name}-packed"), (cfg, True, f"{cfg.name}-dequantized")]


def run(args: argparse.Namespace) -> int:
    """Per-step decode time at each context for the config and for its KDA-only variant."""
    cfg = load_config(args.config)
    contexts = sorted({int(c) for c in args.contexts.split(",")})
    try:
        runs = variants(cfg, args.compare_dequantized)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    for variant, dequantize, name in runs:
        rows += measure(
            variant, contexts, args.batch, args.repeats, args.dtype, args.block_size, dequantize, name
        )
    ratios = {}
    for name in {r["variant"] for r in rows}:
        mine = [r for r in rows if r["variant"] == name]
        ratios[name] = mine[-1]["step_ms"] / mine[0]["step_ms"]
    result = {
        "bench": "decode",
        "config": cfg.name,
        "dtype": args.dtype,
        "environment": environment(),
        "rows": rows,
        f"ratio_{contexts[-1]}_vs_{contexts[0]}": ratios,
    }
    if args.compare_dequantized:
        (packed_name, _), (dense_name, _) = ((n, d) for _, d, n in runs)
        speed = {
            r["context"]: r["tokens_per_s"] / d["tokens_per_s"]
            for r in rows
            if r["variant"] == packed_name
            for d in rows
            if d["variant"] == dense_name and d["context"] == r["context"]
        }
        result["packed_over_dequantized_tokens_per_s"] = speed
    table = Table(
        [{**r, "model": r["model_bytes"], "read/step": r["bytes_per_step"]} for r in rows],
        ["variant", "context", "batch", "step_ms", "tokens_per_s", "model", "read/step"],
        {"step_ms": ".2f", "tokens_per_s": ".1f", "model": fmt_bytes, "read/step": fmt_bytes},
    )
    return report(
        result,
        args,
        table,
        *(f"{name}: step time at {contexts[-1]} / at {contexts[0]} = {r:.2f}" for name, r in ratios.items()),
        *(
            f"packed / dequantized tokens/s at {ctx}: {r:.2f}"
            for ctx, r in result.get("packed_over_dequantized_tokens_per_s", {}).items()
        ),
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode", help="decode step time vs context, config vs its KDA-only variant", description=__doc__
    )
    p.add_argument("--config", default="small", help="config name or path (default small)")
    p.add_argument(
        "--contexts", default="1024,8192", help="comma-separated context lengths (default 1024,8192)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (default 1)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per context (median reported)")
    block = engine_default("block_size")
    p.add_argument("--block-size", type=int, default=block, help=f"KV block size (default {block}, as serve)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    p.add_argument(
        "--compare-dequantized",
        action="store_true",
        help="an MXFP4 config: compare its experts kept packed with them dequantized (instead of the "
        "KDA-only variant)",
    )
    add_out_arg(p)
    p.set_defaults(func=run)

"""`jaxhybrid bench throughput`: prefill and decode tokens/s, and how close they come to the machine's limits.

Prefill: one engine program call over a whole prompt of each `--prompt-lengths` (batch 1, from an empty
cache: what a server does for a prompt that fits one prefill chunk). Decode: the engine's decode program
for each `--batch-sizes` x `--contexts` (rows own distinct KV blocks, caches filled to the context).

In the same run the machine's rates are measured: a square matmul in the run's dtype (FLOP/s) and two
streaming reads of a large fp32 array, a reduction and a matrix-vector product (bytes/s; the faster is the
reference). Each prefill row reports its model FLOP/s as a fraction of the matmul rate, each decode row its
bytes read per second as a fraction of the read bandwidth. How FLOPs and bytes are counted is written into
the result (`counting`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxhybrid.config import ConfigError
from serve.bench.common import (
    add_model_args,
    add_out_arg,
    compile_watch,
    decode_step,
    emit,
    environment,
    load_bench_model,
)
from serve.engine.config import engine_default
from serve.engine.engine import Engine, EngineConfig
from serve.models import UsageError
from serve.report import positive_ints, print_table
from serve.sim.cost import COUNTING, active_params, decode_bytes, param_bytes, prefill_flops


def _median_time(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Compile/warm `fn` (blocking) with two calls, then the median and min of `repeats` timed calls, and
    the compilations seen while timing (0 unless something recompiled)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    fn()
    samples = []
    with compile_watch() as compiles:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return {
        "median_s": float(np.median(samples)),
        "min_s": min(samples),
        "first_call_s": first,
        "compiles_while_timed": compiles["compiles"],
    }


def machine_rates(dtype: str, repeats: int, matmul_size: int, read_mib: int) -> dict[str, Any]:
    """The machine's matmul rate in `dtype` and its streaming read bandwidth (fp32), measured now."""
    import jax
    import jax.numpy as jnp

    n = matmul_size
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, y: x @ y)
    t_mm = _median_time(lambda: mm(a, b).block_until_ready(), repeats)

    side = int(math.sqrt(read_mib * 2**20 // 4))
    x = jax.random.normal(jax.random.key(2), (side, side), jnp.float32)
    v = jnp.ones((side,), jnp.float32)
    nbytes = x.size * x.dtype.itemsize
    total = jax.jit(jnp.sum)
    gemv = jax.jit(lambda m, u: m @ u)
    t_sum = _median_time(lambda: total(x).block_until_ready(), repeats)
    t_gemv = _median_time(lambda: gemv(x, v).block_until_ready(), repeats)
    sum_rate, gemv_rate = nbytes / t_sum["median_s"], nbytes / t_gemv["median_s"]
    return {
        "matmul": {
            "n": n,
            "dtype": dtype,
            "flops": 2 * n**3,
            **t_mm,
            "flop_per_s": 2 * n**3 / t_mm["median_s"],
        },
        "read": {
            "bytes": nbytes,
            "dtype": "float32",
            "sum": {**t_sum, "bytes_per_s": sum_rate},
            "gemv": {**t_gemv, "bytes_per_s": gemv_rate},
        },
        "matmul_flop_per_s": 2 * n**3 / t_mm["median_s"],
        "bandwidth_bytes_per_s": max(sum_rate, gemv_rate),
    }


def measure(
    model: Any,
    prompt_lengths: list[int],
    batches: list[int],
    contexts: list[int],
    dtype: str,
    repeats: int,
    block_size: int,
    rates: dict[str, Any],
) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """Prefill and decode rows for `model` on one engine sized for the largest batch and context."""
    import jax

    cfg = model.config
    params = param_bytes(model)
    active, matmul_params = active_params(cfg, params)
    longest = max(max(contexts) + 1, max(prompt_lengths))
    blocks_per_seq = math.ceil(longest / block_size)
    engine = Engine(
        model,
        EngineConfig(
            max_slots=max(batches),
            block_size=block_size,
            max_model_len=blocks_per_seq * block_size,
            num_blocks=max(batches) * blocks_per_seq + 1,
            kv_dtype=dtype,
            prefix=None,
        ),
    )

    def prefill(length: int) -> Callable[[], None]:
        nblocks = math.ceil(length / block_size)
        table = np.zeros((1, engine.shape.table_width(nblocks)), np.int32)
        table[0, :nblocks] = 1 + np.arange(nblocks)
        tokens = (np.arange(length, dtype=np.int32) % (cfg.vocab_size - 3) + 3)[None]
        zero, valid = np.zeros((1,), np.int32), np.full((1,), length, np.int32)
        return lambda: jax.block_until_ready(engine.runner.run_program(tokens, zero, table, zero, valid))

    prefill_rows = []
    for length in prompt_lengths:
        t = _median_time(prefill(length), repeats)
        flops = prefill_flops(cfg, matmul_params, length)
        rate = flops["flops"] / t["median_s"]
        prefill_rows.append(
            {
                "prompt_len": length,
                "tokens": length,
                **t,
                "tokens_per_s": length / t["median_s"],
                **flops,
                "flop_per_s": rate,
                "matmul_fraction": rate / rates["matmul_flop_per_s"],
            }
        )

    decode_rows = []
    for batch in batches:
        for context in contexts:
            step = decode_step(engine, batch, context, blocks_per_seq)
            t = _median_time(step, repeats)
            nbytes = decode_bytes(cfg, params, batch, context, dtype)
            rate = nbytes["bytes"] / t["median_s"]
            decode_rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "tokens": batch,
                    **t,
                    "tokens_per_s": batch / t["median_s"],
                    **nbytes,
                    "bytes_per_s": rate,
                    "bandwidth_fraction": rate / rates["bandwidth_bytes_per_s"],
                }
            )
    model_info = {
        "config": cfg.name,
        "params": params["elements"],
        "active_params": active,
        "matmul_params_per_token": matmul_params,
        "param_bytes": params["bytes"],
        "routed_expert_bytes": params["routed_bytes"],
        "embedding_bytes": params["embedding_bytes"],
        "mla_layers": cfg.num_mla_layers,
        "kda_layers": cfg.num_kda_layers,
    }
    return prefill_rows, decode_rows, model_info


def run(args: argparse.Namespace) -> int:
    """Prefill and decode tokens/s with the achieved fraction of the measured matmul rate and bandwidth."""
    try:
        prompt_lengths = positive_ints(args.prompt_lengths, "--prompt-lengths")
        batches = positive_ints(args.batch_sizes, "--batch-sizes")
        contexts = positive_ints(args.contexts, "--contexts")
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if args.config is None and args.model is None:
            args.config = "small"
        model = load_bench_model(args)
    except (UsageError, ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = environment()
    matmul_size = args.matmul_size or (2048 if env["platform"] == "cpu" else 8192)
    read_mib = args.read_mib or (256 if env["platform"] == "cpu" else 2048)
    rates = machine_rates(args.dtype, args.repeats, matmul_size, read_mib)
    prefill_rows, decode_rows, model_info = measure(
        model, prompt_lengths, batches, contexts, args.dtype, args.repeats, args.block_size, rates
    )
    result = {
        "bench": "throughput",
        "config": model_info["config"],
        "model_dir": args.model,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "environment": env,
        "machine": rates,
        "model": model_info,
        "counting": COUNTING,
        "prefill": prefill_rows,
        "decode": decode_rows,
    }
    print(
        f"{model_info['config']} {args.dtype} on {env['platform']} ({env['device_kind']}, "
        f"{env['device_count']} device(s)): matmul {rates['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s "
        f"(n={matmul_size}), "
        f"read {rates['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
        file=sys.stderr,
    )
    print_table(
        [
            {
                "prompt_len": r["prompt_len"],
                "ms": f"{1e3 * r['median_s']:.1f}",
                "tokens_per_s": f"{r['tokens_per_s']:.1f}",
                "GFLOP/s": f"{r['flop_per_s'] / 1e9:.2f}",
                "of_matmul": f"{100 * r['matmul_fraction']:.1f}%",
            }
            for r in prefill_rows
        ],
        ["prompt_len", "ms", "tokens_per_s", "GFLOP/s", "of_matmul"],
        file=sys.stderr,
    )
    print_table(
        [
            {
                "batch": r["batch"],
                "context": r["context"],
                "step_ms": f"{1e3 * r['median_s']:.2f}",
                "tokens_per_s": f"{r['tokens_per_s']:.1f}",
                "MB/step": f"{r['bytes'] / 1e6:.2f}",
                "GB/s": f"{r['bytes_per_s'] / 1e9:.2f}",
                "of_bandwidth": f"{100 * r['bandwidth_fraction']:.1f}%",
            }
            for r in decode_rows
        ],
        ["batch", "context", "step_ms", "tokens_per_s", "MB/step", "GB/s", "of_bandwidth"],
        file=sys.stderr,
    )
    emit(result, args)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "throughput",
        help="prefill / decode tokens/s vs the measured matmul rate and memory bandwidth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument(
        "--prompt-lengths", default="128,512,2048", help="prefill prompt lengths (default 128,512,2048)"
    )
    p.add_argument("--batch-sizes", default="1,4,16", help="decode batch sizes (default 1,4,16)")
    p.add_argument("--contexts", default="512,4096", help="decode context lengths (default 512,4096)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed calls per point, after 2 warm-ups (default 5)"
    )
    block = engine_default("block_size")
    p.add_argument("--block-size", type=int, default=block, help=f"KV block size (default {block}, as serve)")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help="n of the n x n peak matmul (default 2048 CPU, 8192 other)",
    )
    p.add_argument(
        "--read-mib", type=int, default=None, help="MiB of the bandwidth array (default 256 CPU, 2048 other)"
    )
    add_out_arg(p)
    p.set_defaults(func=run)

"""`jaxhybrid bench prefix`: replay a multi-turn chat workload through the engine for several prefix-store
settings and report reuse, recompute, time to first token and checkpoint bytes per tier.

The workload (seeded by `--seed`, `serve.bench.chat`): `--conversations` chats share a system prompt of
`--system-len` tokens. Each of `--turns` turns sends the previous prompt + the previous answer + a new user
message of `--user-min`..`--user-max` tokens; with probability `--branch-prob` a chat instead forks from an
earlier turn of itself (a regenerated answer / edited message), so continuations branch. All chats of one
turn are submitted together; turns follow one another.

`--simulate`: no model runs and no weights exist, so any config (`--config kimi-k3`) and any scale: the same
workload goes through the engine's scheduler, prefix store, eviction policy and block allocator with
analytic checkpoint bytes and prefill FLOPs (`serve.bench.simulate`); answers are seeded random ids, TTFT
is estimated from the FLOPs at `--flops-per-s`. `--hbm GB` sizes the KV pool as what is left of one
device's memory after `--weights-gb`, the live states of `--slots` and the checkpoints' device budget
`--device-cache-mb`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from serve.bench.chat import ChatWorkload, Replay, replay
from serve.bench.common import add_out_arg, compile_watch, emit, environment
from serve.report import fmt_bytes, print_table


def settings(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, PrefixStoreConfig or None) per store setting compared: off; each interval alone; prompt- and
    sequence-end checkpoints beside each --prompt-end-interval; each once per --eviction policy."""
    from serve.prefix.store import PrefixStoreConfig

    intervals = sorted({int(x) for x in args.intervals.split(",")}, reverse=True)
    ends = args.prompt_end_interval or str(intervals[-1])
    ends_intervals = sorted({int(x) for x in ends.split(",")}, reverse=True)
    policies = args.eviction.split(",")
    budgets = dict(device_bytes=int(args.device_cache_mb * 2**20), host_bytes=int(args.host_cache_mb * 2**20))
    out: list[tuple[str, Any]] = [("off", None)]
    for policy in policies:
        tag = f" ({policy})" if len(policies) > 1 else ""
        for at_ends, spacing in ((False, intervals), (True, ends_intervals)):
            for interval in spacing:
                cfg = PrefixStoreConfig(
                    checkpoint_interval=interval,
                    prompt_end_checkpoints=at_ends,
                    sequence_end_checkpoints=at_ends,
                    eviction=policy,
                    **budgets,
                )
                name = f"prompt/sequence-end + interval {interval}" if at_ends else f"interval {interval}"
                out.append((name + tag, cfg))
    return out


def engine_config(args: argparse.Namespace, prefix: Any, kv_memory_bytes: int | None = None) -> Any:
    from serve.engine.engine import EngineConfig

    return EngineConfig(
        max_slots=args.slots,
        block_size=args.block_size,
        prefill_chunk=args.chunk,
        max_model_len=args.max_model_len,
        kv_dtype=args.dtype,
        kv_memory_bytes=kv_memory_bytes,
        prefix=prefix,
    )


def run(args: argparse.Namespace) -> int:
    """Reuse, recompute, TTFT and checkpoint bytes for each prefix-store setting on one workload."""
    from jaxhybrid.config import load_config

    cfg = load_config(args.config)
    workload = ChatWorkload.from_args(args)
    if args.simulate:
        rows, extra = _simulated_rows(cfg, args, workload)
    else:
        if args.hbm is not None:
            raise SystemExit("error: --hbm needs --simulate")
        rows, extra = _engine_rows(cfg, args, workload), {}
    result = {
        "bench": "prefix",
        "config": cfg.name,
        "simulated": bool(args.simulate),
        "block_size": args.block_size,
        "dtype": args.dtype,
        "workload": dataclasses.asdict(workload),
        **extra,
        "environment": environment(),
        "rows": rows,
    }
    columns = ["setting", "hit_rate", "hit_tokens", "recomputed_tokens", "ttft_mean_ms", "ttft_p95_ms"]
    columns += ["peak_ckpt_device", "peak_ckpt_host"]
    columns += ["recomputed_per_req", "prefill_PFLOP", "fit"] if args.simulate else ["compiles_while_timed"]
    print_table([_cells(r) for r in rows], columns, file=sys.stderr)
    emit(result, args)
    return 0


def _cells(r: dict[str, Any]) -> dict[str, Any]:
    cells = {
        **r,
        "hit_rate": f"{r['hit_rate']:.3f}",
        "ttft_mean_ms": f"{r['ttft_mean_ms']:.1f}",
        "ttft_p95_ms": f"{r['ttft_p95_ms']:.1f}",
        "peak_ckpt_device": r["peak_checkpoint_bytes"]["device"],
        "peak_ckpt_host": r["peak_checkpoint_bytes"]["host"],
    }
    if "prefill_flops" in r:
        cells.update(
            recomputed_per_req=f"{r['recomputed_per_request']:.0f}",
            prefill_PFLOP=f"{r['prefill_flops'] / 1e15:.1f}",
            peak_ckpt_device=fmt_bytes(r["peak_checkpoint_bytes"]["device"]),
            peak_ckpt_host=fmt_bytes(r["peak_checkpoint_bytes"]["host"]),
            fit=r.get("sequences_fit", ""),
        )
    return cells


def _engine_rows(cfg: Any, args: argparse.Namespace, workload: ChatWorkload) -> list[dict[str, Any]]:
    import jax.numpy as jnp
    from flax import nnx

    from jaxhybrid.model import HybridLM
    from serve.engine.engine import Engine

    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
    configs = [(name, engine_config(args, prefix)) for name, prefix in settings(args)]
    # The same workload once on a fresh engine of every setting first. The scheduler is deterministic, so the
    # measured replay meets exactly the shapes this compiled (a warm-up of another seed missed some, and the
    # first setting measured paid their compiles). `compiles_while_timed` checks it.
    for _, engine_cfg in configs:
        replay(Engine(model, engine_cfg), workload, cfg.vocab_size)
    rows = []
    for name, engine_cfg in configs:
        engine = Engine(model, engine_cfg)
        with compile_watch() as compiles:
            row = replay(engine, workload, cfg.vocab_size).summary()
        rows.append({"setting": name, **row, "compiles_while_timed": compiles["compiles"]})
    return rows


def simulated_kv_bytes(cfg: Any, args: argparse.Namespace) -> int | None:
    """The KV pool of a simulation: with --hbm, one device's memory less the weights, the live states of every
    slot and the checkpoints' device budget; else the engine's default (every slot at --max-model-len)."""
    from serve.engine.config import EngineShape

    if args.hbm is None:
        return None
    state = EngineShape.resolve(engine_config(args, None), cfg).state_bytes
    left = int((args.hbm - args.weights_gb) * 1e9) - args.slots * state - int(args.device_cache_mb * 2**20)
    if left <= 0:
        raise SystemExit(
            f"error: --hbm {args.hbm:g} GB leaves nothing for the KV pool after --weights-gb, the states of "
            f"{args.slots} slots ({args.slots * state / 1e9:.2f} GB) and --device-cache-mb"
        )
    return left


def _simulated_rows(
    cfg: Any, args: argparse.Namespace, workload: ChatWorkload
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import time

    from serve.bench.simulate import CostModel, SimEngine, random_answers

    cost = CostModel.of(cfg, args.flops_per_s)
    kv_bytes = simulated_kv_bytes(cfg, args)
    rows = []
    shape = None
    for name, prefix in settings(args):
        t0 = time.perf_counter()
        sim = SimEngine(
            cfg, engine_config(args, prefix, kv_bytes), random_answers(cfg.vocab_size, args.seed), cost
        )
        shape = sim.shape
        rep = replay(sim, workload, cfg.vocab_size)
        rows.append(
            {"setting": name, **_simulated_row(rep, sim, args), "wall_s": round(time.perf_counter() - t0, 2)}
        )
    extra = {
        "flops_per_s": args.flops_per_s,
        "matmul_params": cost.matmul_params,
        "hbm_gb": args.hbm,
        "weights_gb": args.weights_gb,
        "kv_pool_bytes": shape.num_blocks * shape.block_bytes,
        "kv_pool_blocks": shape.num_blocks,
        "block_bytes": shape.block_bytes,
        "state_bytes": shape.state_bytes,
        "slots": args.slots,
        "device_cache_bytes": int(args.device_cache_mb * 2**20),
        "host_cache_bytes": int(args.host_cache_mb * 2**20),
    }
    return rows, extra


def _simulated_row(rep: Replay, sim: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The bench's row plus what a simulation adds: FLOPs, per-request recompute, the store's counters, and
    the sequences that fit in --hbm (see the flag)."""
    row = rep.summary()
    last = rep.ledgers[-1]
    row.update(
        recomputed_per_request=row["recomputed_tokens"] / row["requests"],
        prefill_flops=sim.flops["prefill"],
        decode_flops=sim.flops["decode"],
        simulated_s=sim.clock,
        steps=sim.steps,
        **{k: last.get(k, 0) for k in ("saves", "demotions", "dropped_checkpoints", "evicted_blocks")},
        checkpoints_by_kind=last["checkpoints_by_kind"],
        checkpoint_bytes_by_kind=last["checkpoint_bytes_by_kind"],
    )
    if args.hbm is not None:
        from jaxhybrid.cache import mla_kv_bytes

        final = rep.stats[-args.conversations :]
        context = sum(s["prompt_tokens"] + s["generated_tokens"] for s in final) / len(final)
        held = (last["checkpoint_bytes"]["device"] + last["checkpoint_bytes"]["host"]) / args.conversations
        per_seq = mla_kv_bytes(sim.model_config, int(context), sim.shape.kv_dtype) + sim.shape.state_bytes
        cache = (args.hbm - args.weights_gb) * 1e9
        row.update(
            mean_final_context=context,
            checkpoint_bytes_per_conversation=held,
            sequences_fit=int(cache // (per_seq + held)),
            sequences_fit_without_checkpoints=int(cache // per_seq),
        )
    return row


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefix", help="multi-turn workload replay over prefix-store settings", description=__doc__
    )
    p.add_argument("--config", default="tiny", help="config name or path (default tiny)")
    p.add_argument(
        "--intervals", default="16,64,256", help="checkpoint intervals to compare (default 16,64,256)"
    )
    p.add_argument(
        "--prompt-end-interval",
        default=None,
        help="interval(s) beside the prompt/sequence-end checkpoints, comma-separated (default: the "
        "smallest of --intervals)",
    )
    p.add_argument("--eviction", default="lru", help="eviction policies to compare, comma-separated (lru)")
    p.add_argument("--conversations", type=int, default=6, help="chats (default 6)")
    p.add_argument("--turns", type=int, default=4, help="turns per chat (default 4)")
    p.add_argument("--system-len", type=int, default=100, help="shared system prompt tokens (default 100)")
    p.add_argument("--user-min", type=int, default=8, help="shortest user message (default 8)")
    p.add_argument("--user-max", type=int, default=40, help="longest user message (default 40)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn (default 16)")
    p.add_argument(
        "--branch-prob", type=float, default=0.25, help="chance a turn forks an earlier turn (0.25)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--slots", type=int, default=4, help="engine slots (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (default 64)")
    p.add_argument("--max-model-len", type=int, default=1024, help="context limit (default 1024)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    p.add_argument(
        "--device-cache-mb",
        type=float,
        default=1024.0,
        help="the store's device budget for checkpoints, MiB (default 1024)",
    )
    p.add_argument(
        "--host-cache-mb", type=float, default=4096.0, help="the store's host budget, MiB (default 4096)"
    )
    s = p.add_argument_group("simulation (no model, no weights: any config, any scale)")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="drive the engine's scheduler and prefix store with analytic bytes and FLOPs, no model",
    )
    s.add_argument(
        "--hbm",
        type=float,
        default=None,
        help="device memory in GB (1e9 B): the KV pool is what is left after --weights-gb, the slots' live "
        "states and --device-cache-mb; also reports the sequences that fit (default: the engine's pool, "
        "every slot at --max-model-len)",
    )
    s.add_argument("--weights-gb", type=float, default=0.0, help="with --hbm: weights per device, GB (0)")
    s.add_argument(
        "--flops-per-s",
        type=float,
        default=1e15,
        help="FLOP rate the simulated TTFT is computed at (default 1e15)",
    )
    add_out_arg(p)
    p.set_defaults(func=run)

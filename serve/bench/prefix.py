"""`jaxhybrid bench prefix`: replay a multi-turn chat workload through the engine for several prefix-store
settings and report reuse, recompute, time to first token and checkpoint bytes per tier.

The workload (seeded by `--seed`): `--conversations` chats share a system prompt of `--system-len`
tokens. Each of `--turns` turns sends the previous prompt + the model's previous answer + a new user
message of `--user-min`..`--user-max` tokens; with probability `--branch-prob` a chat instead forks
from an earlier turn of itself (a regenerated answer / edited message), so continuations branch. All
chats of one turn are submitted together; turns follow one another.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from serve.bench.common import add_out_arg, compile_watch, emit, environment
from serve.report import print_table


def replay(engine, args: argparse.Namespace, vocab: int) -> dict:
    from serve.engine.sampling import SamplingParams

    rng = np.random.default_rng(args.seed)
    tok = lambda n: rng.integers(3, vocab, n).tolist()
    system = tok(args.system_len)
    history: list[list[list[int]]] = [[system] for _ in range(args.conversations)]  # prompts per chat
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ttft, prompt_tokens, hit, recomputed = [], 0, 0, 0
    peak = {"device": 0, "host": 0, "disk": 0}
    for _ in range(args.turns):
        prompts = []
        for chat in history:
            base = (
                chat[int(rng.integers(1, len(chat)))]
                if len(chat) > 1 and rng.random() < args.branch_prob
                else chat[-1]
            )
            prompts.append(base + tok(int(rng.integers(args.user_min, args.user_max + 1))))
        results = engine.generate(prompts, params)
        for chat, prompt, res in zip(history, prompts, results, strict=True):
            chat.append(prompt + res.token_ids)
            ttft.append(res.stats["time_to_first_token_s"])
            prompt_tokens += len(prompt)
            hit += res.stats["prefix_hit_tokens"]
            recomputed += res.stats["recomputed_tokens"]
        ledger = engine.ledger()
        for tier in peak:
            peak[tier] = max(peak[tier], ledger["checkpoint_bytes"][tier])
    ms = 1e3 * np.asarray(ttft)
    return {
        "requests": len(ttft),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit,
        "hit_rate": hit / prompt_tokens,
        "recomputed_tokens": recomputed,
        "ttft_mean_ms": float(ms.mean()),
        "ttft_p95_ms": float(np.percentile(ms, 95)),
        "peak_checkpoint_bytes": peak,
        "hits": engine.ledger().get("hits", 0),
    }


def run(args: argparse.Namespace) -> int:
    """Reuse, recompute, TTFT and checkpoint bytes for each prefix-store setting on one workload."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM
    from serve.engine.engine import Engine, EngineConfig
    from serve.prefix.store import PrefixStoreConfig

    cfg = load_config(args.config)
    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
    intervals = sorted({int(x) for x in args.intervals.split(",")}, reverse=True)
    pe_interval = args.prompt_end_interval or intervals[-1]
    settings: list[tuple[str, PrefixStoreConfig | None]] = [("off", None)]
    for interval in intervals:
        settings.append(
            (
                f"interval {interval}",
                PrefixStoreConfig(
                    checkpoint_interval=interval, prompt_end_checkpoints=False, sequence_end_checkpoints=False
                ),
            )
        )
    settings.append(
        (
            f"prompt/sequence-end + interval {pe_interval}",
            PrefixStoreConfig(
                checkpoint_interval=pe_interval, prompt_end_checkpoints=True, sequence_end_checkpoints=True
            ),
        )
    )
    configs = [
        (
            name,
            EngineConfig(
                max_slots=args.slots,
                block_size=args.block_size,
                prefill_chunk=args.chunk,
                max_model_len=args.max_model_len,
                kv_dtype=args.dtype,
                prefix=prefix,
            ),
        )
        for name, prefix in settings
    ]
    # The same workload once on a fresh engine of every setting first. The scheduler is deterministic, so the
    # measured replay meets exactly the shapes this compiled (a warm-up of another seed missed some, and the
    # first setting measured paid their compiles). `compiles_while_timed` checks it.
    for _, engine_cfg in configs:
        replay(Engine(model, engine_cfg), args, cfg.vocab_size)
    rows = []
    for name, engine_cfg in configs:
        engine = Engine(model, engine_cfg)
        with compile_watch() as compiles:
            row = replay(engine, args, cfg.vocab_size)
        rows.append({"setting": name, **row, "compiles_while_timed": compiles["compiles"]})
    workload = {
        k: getattr(args, k)
        for k in (
            "seed",
            "conversations",
            "turns",
            "system_len",
            "user_min",
            "user_max",
            "max_tokens",
            "branch_prob",
        )
    }
    result = {
        "bench": "prefix",
        "config": cfg.name,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "workload": workload,
        "environment": environment(),
        "rows": rows,
    }
    print_table(
        [
            {
                **r,
                "hit_rate": f"{r['hit_rate']:.3f}",
                "ttft_mean_ms": f"{r['ttft_mean_ms']:.1f}",
                "ttft_p95_ms": f"{r['ttft_p95_ms']:.1f}",
                "peak_ckpt_device": r["peak_checkpoint_bytes"]["device"],
                "peak_ckpt_host": r["peak_checkpoint_bytes"]["host"],
            }
            for r in rows
        ],
        [
            "setting",
            "hit_rate",
            "hit_tokens",
            "recomputed_tokens",
            "ttft_mean_ms",
            "ttft_p95_ms",
            "peak_ckpt_device",
            "peak_ckpt_host",
            "compiles_while_timed",
        ],
        file=sys.stderr,
    )
    emit(result, args)
    return 0


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
        type=int,
        default=None,
        help="interval beside the prompt/sequence-end checkpoints (default: the smallest of --intervals)",
    )
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
    add_out_arg(p)
    p.set_defaults(func=run)

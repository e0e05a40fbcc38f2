"""`jaxhybrid bench ttft`: time to first token for a long prompt, cold vs after a prefix-store hit.

A follow-up prompt extends an earlier prompt of `--prompt-len` tokens by `--suffix` tokens (the next turn
of a chat). Three engines serve it after the earlier prompt: no prefix store (cold), interval
checkpoints only (the hit ends at the last multiple of `--interval`), and prompt-end checkpoints (the
hit covers the whole earlier prompt). Each reports TTFT, hit and recomputed tokens, and the bytes its
store held.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.common import add_out_arg, environment
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.prefix.store import PrefixStoreConfig


def run(args: argparse.Namespace) -> int:
    """TTFT of a follow-up prompt: cold, interval hit, prompt-end hit."""
    import jax.numpy as jnp
    from flax import nnx

    cfg = load_config(args.config)
    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
    move_to_huge_pages(model)  # as the server's loader does
    rng = np.random.default_rng(args.seed)
    first = rng.integers(3, cfg.vocab_size, args.prompt_len).tolist()
    follow = first + rng.integers(3, cfg.vocab_size, args.suffix).tolist()
    warm_first = rng.integers(3, cfg.vocab_size, args.prompt_len).tolist()
    warm_follow = warm_first + rng.integers(3, cfg.vocab_size, args.suffix).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    variants = {
        "cold": None,
        "interval": PrefixStoreConfig(
            checkpoint_policy="fixed",
            checkpoint_interval=args.interval,
            prompt_end_checkpoints=False,
            sequence_end_checkpoints=False,
        ),
        "prompt_end": PrefixStoreConfig(
            checkpoint_policy="fixed",
            checkpoint_interval=args.interval,
            prompt_end_checkpoints=True,
            sequence_end_checkpoints=False,
        ),
    }
    rows = []
    for name, prefix in variants.items():
        engine = Engine(
            model,
            EngineConfig(
                max_slots=1,
                block_size=args.block_size,
                prefill_chunk=args.chunk,
                max_model_len=len(follow) + 8,
                kv_dtype=args.dtype,
                prefix=prefix,
            ),
        )
        for prompt in (warm_first, warm_follow, first):  # the same shapes once, so no compile is timed
            engine.generate([prompt], one)
        res = engine.generate([follow], one)[0]
        ledger = engine.ledger().prefix
        rows.append(
            {
                "variant": name,
                "ttft_ms": 1e3 * res.stats["time_to_first_token_s"],
                "hit_tokens": res.stats["prefix_hit_tokens"],
                "recomputed_tokens": res.stats["recomputed_tokens"],
                "prefilled_tokens": res.stats["prefill_tokens_computed"],
                "checkpoints": ledger.checkpoints.total(),
                "checkpoint_bytes": ledger.checkpoint_bytes.total(),
                "cached_kv_bytes": ledger.cached_kv_bytes,
            }
        )
    cold = rows[0]["ttft_ms"]
    for row in rows:
        row["speedup_vs_cold"] = cold / row["ttft_ms"]
    result = {
        "bench": "ttft",
        "config": cfg.name,
        "prompt_len": args.prompt_len,
        "suffix": args.suffix,
        "interval": args.interval,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "environment": environment(),
        "rows": rows,
    }
    columns = [
        "variant",
        "ttft_ms",
        "speedup_vs_cold",
        "hit_tokens",
        "recomputed_tokens",
        "checkpoints",
        "checkpoint_bytes",
        "cached_kv_bytes",
    ]
    return report(result, args, Table(rows, columns, {"ttft_ms": ".1f", "speedup_vs_cold": ".2f"}))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ttft", help="time to first token: cold vs interval hit vs prompt-end hit", description=__doc__
    )
    p.add_argument("--config", default="small", help="config name or path (default small)")
    p.add_argument("--prompt-len", type=int, default=1000, help="tokens of the earlier prompt (default 1000)")
    p.add_argument("--suffix", type=int, default=24, help="tokens the follow-up adds (default 24)")
    p.add_argument("--interval", type=int, default=256, help="checkpoint interval (default 256)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    add_out_arg(p)
    p.set_defaults(func=run)

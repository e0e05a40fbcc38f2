"""`jaxhybrid bench checkpoint-dtype [--model DIR | --config NAME] [--checkpoint-dtype bfloat16]`: what
resuming from a prefix-store checkpoint kept in a narrower dtype costs, against an exact resume.

Teacher-forced: over `--windows` windows of `--resume` + `--continuation` tokens (the shipped model or a
`--model`: this repository's Python source through its tokenizer, which the shipped model never saw; a
`--config`: random weights and seeded random ids), the model runs the first `--resume` tokens, its KDA
states (recurrent state and conv window) are rounded to the checkpoint dtype and back exactly as the store's
copy and restore do (`jaxhybrid.cache.narrowed`), and it runs the continuation from them; against the same
run from the unrounded states it reports per-token |delta logprob| of the text's next tokens (max and mean),
the difference in nats/token, top-1 agreement and KL(exact || rounded).

Greedy, through the engine and its prefix store: each window's first `--resume` tokens are served as a
prompt (computed from scratch and checkpointed at its end), then served again, resumed from that prompt-end
checkpoint (its kept logits give the first token); the two completions of `--greedy-tokens` are compared:
tokens equal before the first difference, and positions equal. A float32 store is the control (identical).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

from benchmarks.quant import agreed_prefix
from benchmarks.report import Table, report
from jaxhybrid.cache import CHECKPOINT_DTYPES, KDACache, narrowed
from jaxhybrid.tokenizer import load_tokenizer
from serve.bench.common import add_model_args, add_out_arg, environment, load_bench_model
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.prefix.store import PrefixStoreConfig

REPO = Path(__file__).resolve().parents[2]
TEXT_SOURCES = (
    "serve/engine/scheduler.py",
    "serve/prefix/store.py",
    "jaxhybrid/ops/kda.py",
    "sharding/rules.py",
)


def windows(model: Any, args: argparse.Namespace) -> Any:
    """[windows, resume + continuation + 1] int32 token ids (see the module doc)."""
    import numpy as np

    length = args.resume + args.continuation + 1
    if args.model:
        tok = load_tokenizer(args.model, model.config)
        ids = np.concatenate([tok.encode((REPO / p).read_text()) for p in TEXT_SOURCES]).astype(np.int32)
        if len(ids) < args.windows * length:
            raise ValueError(
                f"the text holds {len(ids)} tokens, fewer than {args.windows} windows of {length}"
            )
        return ids[: args.windows * length].reshape(args.windows, length)
    rng = np.random.default_rng(args.seed)
    return rng.integers(3, model.config.vocab_size, (args.windows, length)).astype(np.int32)


def rounded(cache: Any, dtype: str) -> Any:
    """`cache` with each KDA layer's states rounded to `dtype` and back (a checkpoint's copy, restored)."""
    back = lambda x: x.astype(narrowed(x.dtype, dtype)).astype(x.dtype)  # noqa: E731
    return tuple(KDACache(back(c.conv), back(c.state)) if isinstance(c, KDACache) else c for c in cache)


@functools.cache
def _compare(dtype: str, resume: int) -> Any:
    """The jitted teacher-forced comparison of one batch of windows (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def compare(model: Any, tokens: jax.Array) -> dict[str, jax.Array]:
        cache = model.init_cache(tokens.shape[0], tokens.shape[1])
        _, cache = model.forward_cached(tokens[:, :resume], cache)
        x, y = tokens[:, resume:-1], tokens[:, resume + 1 :]
        logp = jax.nn.log_softmax(model.forward_cached(x, cache)[0].astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(
            model.forward_cached(x, rounded(cache, dtype))[0].astype(jnp.float32), axis=-1
        )
        at = lambda lp: jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0]  # noqa: E731
        return {
            "delta": jnp.abs(at(logp) - at(logq)),
            "nats_exact": -at(logp).mean(),
            "nats_rounded": -at(logq).mean(),
            "top1_agree": (logp.argmax(-1) == logq.argmax(-1)).mean(),
            "kl": (jnp.exp(logp) * (logp - logq)).sum(-1).mean(),
        }

    return compare


def teacher_forced(model: Any, tokens: Any, args: argparse.Namespace) -> dict[str, float]:
    import jax.numpy as jnp
    import numpy as np

    out = _compare(args.checkpoint_dtype, args.resume)(model, jnp.asarray(tokens))
    delta = np.asarray(out["delta"])
    return {
        "max_abs_delta_logprob": float(delta.max()),
        "mean_abs_delta_logprob": float(delta.mean()),
        "p99_abs_delta_logprob": float(np.quantile(delta, 0.99)),
        "nats_per_token_exact": float(out["nats_exact"]),
        "nats_per_token_rounded": float(out["nats_rounded"]),
        "delta_nats_per_token": float(out["nats_rounded"] - out["nats_exact"]),
        "top1_agree": float(out["top1_agree"]),
        "kl": float(out["kl"]),
        "tokens": int(delta.size),
    }


def greedy_resumed(
    model: Any, prompts: list[list[int]], dtype: str, n: int
) -> list[tuple[list[int], list[int]]]:
    """(computed from scratch, resumed from its prompt-end checkpoint in `dtype`) completions per prompt."""
    prefix = PrefixStoreConfig(checkpoint_dtype=dtype, sequence_end_checkpoints=False)
    length = max(len(p) for p in prompts) + n
    engine = Engine(
        model, EngineConfig(max_slots=len(prompts), block_size=16, max_model_len=length, prefix=prefix)
    )
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    if any(r.stats["prefix_hit_tokens"] != len(p) for p, r in zip(prompts, again, strict=True)):
        raise RuntimeError("a prompt was not resumed from its prompt-end checkpoint")
    return [(list(a.token_ids), list(b.token_ids)) for a, b in zip(first, again, strict=True)]


def run(args: argparse.Namespace) -> int:
    model = load_bench_model(args)
    tokens = windows(model, args)
    t0 = time.perf_counter()
    forced = teacher_forced(model, tokens, args)
    t1 = time.perf_counter()
    greedy = []
    if args.greedy_tokens:
        prompts = [[int(t) for t in row[: args.resume]] for row in tokens]
        for dtype in ("float32", args.checkpoint_dtype):
            pairs = greedy_resumed(model, prompts, dtype, args.greedy_tokens)
            agreed = [agreed_prefix(a, b) for a, b in pairs]
            same = [sum(x == y for x, y in zip(a, b, strict=True)) for a, b in pairs]
            greedy.append(
                {
                    "checkpoint_dtype": dtype,
                    "agreed_tokens": agreed,
                    "same_positions": same,
                    "identical": sum(a == args.greedy_tokens for a in agreed),
                }
            )
    result = {
        "bench": "checkpoint-dtype",
        "model": args.model or args.config,
        "dtype": args.dtype,
        "checkpoint_dtype": args.checkpoint_dtype,
        "windows": args.windows,
        "resume": args.resume,
        "continuation": args.continuation,
        "text": "repository source" if args.model else "random ids",
        "teacher_forced": forced,
        "teacher_forced_s": round(t1 - t0, 1),
        "greedy_tokens": args.greedy_tokens,
        "greedy": greedy,
        "greedy_s": round(time.perf_counter() - t1, 1),
        "environment": environment(),
    }
    drift = Table(
        [
            {
                "max |dlogp|": forced["max_abs_delta_logprob"],
                "mean |dlogp|": forced["mean_abs_delta_logprob"],
                "p99 |dlogp|": forced["p99_abs_delta_logprob"],
                "d nats/token": forced["delta_nats_per_token"],
                "top-1 agree": forced["top1_agree"],
                "KL nats": forced["kl"],
            }
        ],
        ["max |dlogp|", "mean |dlogp|", "p99 |dlogp|", "d nats/token", "top-1 agree", "KL nats"],
        {
            "max |dlogp|": ".2e",
            "mean |dlogp|": ".2e",
            "p99 |dlogp|": ".2e",
            "d nats/token": "+.2e",
            "top-1 agree": ".4f",
            "KL nats": ".2e",
        },
        title=f"{result['model']}: resumed after {args.resume} tokens from a {args.checkpoint_dtype} "
        f"checkpoint, {args.windows} windows x {args.continuation} teacher-forced tokens ({result['text']})",
    )
    agreement = (
        f"greedy {args.greedy_tokens} tokens, resumed from a {g['checkpoint_dtype']} prompt-end checkpoint: "
        f"{g['identical']}/{len(g['agreed_tokens'])} identical; equal before the first difference "
        f"{g['agreed_tokens']}"
        for g in greedy
    )
    return report(result, args, drift, *agreement)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoint-dtype",
        help="logprob drift and greedy agreement after resuming from a checkpoint in a narrower dtype",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p, default_config="the shipped model")
    p.add_argument("--dtype", default=None, help="dtype the model runs in (default: as serve picks)")
    p.add_argument(
        "--checkpoint-dtype",
        choices=[d for d in CHECKPOINT_DTYPES if d != "float32"],
        default="bfloat16",
        help="the checkpoints' dtype measured against float32 (default bfloat16)",
    )
    p.add_argument("--windows", type=int, default=8, help="windows (default 8)")
    p.add_argument("--resume", type=int, default=512, help="tokens before the resume (default 512)")
    p.add_argument(
        "--continuation", type=int, default=512, help="teacher-forced tokens after it (default 512)"
    )
    p.add_argument("--greedy-tokens", type=int, default=128, help="greedy tokens per window (0: none)")
    add_out_arg(p)
    p.set_defaults(func=run)

"""`jaxhybrid memory`: how much of the memory a fixed-size state saves survives prefix reuse (analytic)."""

from __future__ import annotations

import argparse
import json
import sys

from jaxhybrid.cache import layout_report, memory_report
from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.weights import CheckpointError
from serve.cli.common import add_config_arg
from serve.models import add_checkpoint_dtype_arg, checkpoint_dir, serving_dtype
from serve.prefix.ledger import Chat, CheckpointPolicy, chat_report
from serve.report import DTYPES, fmt_bytes, positive_ints, print_table

# the --turns rows: ledger kind, name, what follows the count ({every}: the interval)
CHAT_KINDS = (
    ("interval", "interval", " x {every}"),
    ("prompt_end", "prompt-end", ""),
    ("sequence_end", "sequence-end", ""),
)
CHAT_ONLY = ("turn_tokens", "reply_tokens", "no_prompt_end_checkpoints", "no_sequence_end_checkpoints")


def run(args: argparse.Namespace) -> int:
    """Per-sequence bytes at a context: MLA latent KV, KDA live state, state checkpoints every --interval
    tokens, against an all-MLA model of the same depth; nothing is allocated. With --turns: at the end of a
    chat of N turns of T tokens (context N*T), with every checkpoint the engine's prefix store keeps for it
    (interval, prompt end, sequence end; a partial last block's KV in those off a block boundary)."""
    import jax.numpy as jnp

    try:
        cfg = load_config(args.config)
        choice = serving_dtype(args.dtype, checkpoint_dir(args.config))
        args.dtype, args.dtype_reason = choice.dtype, choice.reason
        hbm = None if args.hbm is None else int(args.hbm * 1e9)
        if args.ratios:
            return _ratios(cfg, args, hbm)
        if args.turns is not None:
            rep = _chat_report(cfg, args, hbm)
        elif any(getattr(args, f) not in (None, False) for f in CHAT_ONLY):
            raise ValueError("--turn-tokens, --reply-tokens and --no-*-end-checkpoints need --turns")
        elif args.context is None:
            raise ValueError("--context is required (or --turns, or --ratios with --contexts)")
        else:
            rep = memory_report(
                cfg,
                args.context,
                args.interval or None,
                jnp.dtype(args.dtype),
                hbm,
                None,
                args.checkpoint_dtype,
            )
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rep = {**rep, "dtype_reason": choice.reason}
    if args.json:
        print(json.dumps(rep))
        return 0
    gb = lambda n: f"{n / 1e9:,.2f} GB"
    print(
        f"{cfg.name}: {cfg.num_kda_layers} KDA + {cfg.num_mla_layers} MLA layers, context {rep['context']:,} "
        f"tokens, KV dtype {choice.describe()}, as `serve` would allocate it (recurrent state fp32, "
        f"checkpoints in {rep['checkpoint_dtype']})"
    )
    every = f"every {args.interval or '-'} tokens"
    if "chat" in rep:
        chat = rep["chat"]
        print(
            f"  a chat of {chat['turns']} turns x {chat['turn_tokens']:,} tokens "
            f"({chat['reply_tokens']:,} of them the reply), KV blocks of {chat['block_size']}"
        )
        checkpoints = [
            (
                f"{name} checkpoints ({rep['checkpoints_by_kind'][kind]}{extra.format(every=every)}; "
                f"{rep['checkpoint_tails_by_kind'][kind]} hold a partial KV block)",
                rep["checkpoint_bytes_by_kind"][kind],
            )
            for kind, name, extra in CHAT_KINDS
        ]
        checkpoints.append((f"all checkpoints ({rep['num_checkpoints']})", rep["checkpoint_bytes"]))
    else:
        checkpoints = [(f"state checkpoints ({rep['num_checkpoints']} x {every})", rep["checkpoint_bytes"])]
    rows = [
        ("MLA latent KV", rep["kv_bytes"]),
        ("KDA live state (recurrent + conv)", rep["state_bytes"]),
        *checkpoints,
        ("total per sequence", rep["total_bytes"]),
        (f"all-MLA model, {cfg.num_hidden_layers} layers", rep["all_mla_kv_bytes"]),
    ]
    width = max(len(r[0]) for r in rows)
    for name, n in rows:
        print(f"  {name:<{width}}  {n:>22,} B  {gb(n):>12}  {fmt_bytes(n):>12}")
    print(
        f"  saving vs all-MLA: {rep['saving_pct']:.1f}% with checkpoints, "
        f"{rep['saving_pct_without_checkpoints']:.1f}% without"
    )
    if hbm is not None:
        print(
            f"  sequences that fit in {args.hbm:g} GB (cache only, weights not subtracted): "
            f"{rep['sequences_fit']} with checkpoints, {rep['sequences_fit_without_checkpoints']} without, "
            f"{rep['sequences_fit_all_mla']} all-MLA"
        )
    return 0


def _chat_report(cfg, args: argparse.Namespace, hbm: int | None) -> dict:
    """The ledger at the end of the --turns chat, checkpoints by kind."""
    import jax.numpy as jnp

    if args.turn_tokens is None:
        raise ValueError("--turns needs --turn-tokens")
    reply = args.reply_tokens if args.reply_tokens is not None else max(1, args.turn_tokens // 4)
    chat = Chat(args.turns, args.turn_tokens, reply)
    if args.context is not None and args.context != chat.context:
        raise ValueError(
            f"--context ({args.context}) must be --turns x --turn-tokens ({chat.context}) or unset"
        )
    policy = CheckpointPolicy(
        interval=args.interval or None,
        block_size=args.block_size,
        prompt_end=not args.no_prompt_end_checkpoints,
        sequence_end=not args.no_sequence_end_checkpoints,
    )
    return chat_report(cfg, chat, policy, jnp.dtype(args.dtype), hbm, args.checkpoint_dtype)


def _ratios(cfg, args: argparse.Namespace, hbm: int | None) -> int:
    """The layout what-if: per-sequence bytes (and sequences that fit in --hbm) for every KDA:MLA mix."""
    import jax.numpy as jnp

    contexts = positive_ints(args.contexts, "--contexts")
    if args.context is not None:
        contexts = sorted({*contexts, args.context})
    rows = layout_report(cfg, contexts, args.interval, jnp.dtype(args.dtype), hbm, args.checkpoint_dtype)
    if args.json:
        dtype = {"dtype": args.dtype, "dtype_reason": args.dtype_reason}
        print(json.dumps({"config": cfg.name, "interval": args.interval, **dtype, "layouts": rows}))
        return 0
    print(
        f"{cfg.name}: {cfg.num_hidden_layers} layers as every KDA:MLA mix; per-sequence cache, KV dtype "
        f"{args.dtype} ({args.dtype_reason}), checkpoints every {args.interval or '-'} tokens in "
        f"{args.checkpoint_dtype}"
    )
    columns = ["layout", "kda", "mla", "context", "no_checkpoints", "with_checkpoints", "vs_all_MLA"]
    fit = "fit" if args.hbm is None else f"fit_{args.hbm:g}GB"
    if hbm is not None:
        columns += [fit, "fit_no_checkpoints"]
    print_table(
        [
            {
                "layout": r["layout"],
                "kda": r["kda_layers"],
                "mla": r["mla_layers"],
                "context": f"{r['context']:,}",
                "no_checkpoints": fmt_bytes(r["bytes_without_checkpoints"]),
                "with_checkpoints": fmt_bytes(r["total_bytes"]),
                "vs_all_MLA": f"{100 * r['total_bytes'] / r['all_mla_kv_bytes']:.1f}%",
                fit: r.get("sequences_fit"),
                "fit_no_checkpoints": r.get("sequences_fit_without_checkpoints"),
            }
            for r in rows
        ],
        columns,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "memory",
        help="analytic per-sequence memory: KV, state, checkpoints vs all-MLA",
        description=run.__doc__,
    )
    add_config_arg(p, required=True)
    p.add_argument(
        "--context", type=int, help="tokens per sequence (required unless --turns or --ratios; --turns: N*T)"
    )
    c = p.add_argument_group("chat (every checkpoint kind the engine keeps)")
    c.add_argument("--turns", type=int, help="a chat of N turns: report it at its end (context N*T)")
    c.add_argument("--turn-tokens", type=int, help="with --turns: tokens each turn adds, prompt + reply (T)")
    c.add_argument(
        "--reply-tokens", type=int, help="with --turns: of each turn's T tokens, the reply's (default T/4)"
    )
    c.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="with --turns: the KV block size (default 16), for partial blocks in checkpoints",
    )
    c.add_argument(
        "--no-prompt-end-checkpoints",
        action="store_true",
        help="with --turns: as the engine's flag, no checkpoint at the end of each prompt",
    )
    c.add_argument(
        "--no-sequence-end-checkpoints",
        action="store_true",
        help="with --turns: as the engine's flag, no checkpoint at the end of each finished sequence",
    )
    p.add_argument(
        "--ratios",
        action="store_true",
        help="the layout what-if: the config's depth and widths as all-MLA, 1:1, 3:1, 7:1 and all-KDA",
    )
    p.add_argument(
        "--contexts",
        default="131072,1048576",
        help="with --ratios: context lengths (default 131072,1048576; --context adds one)",
    )
    p.add_argument(
        "--interval",
        type=int,
        default=32768,
        help="state checkpoint interval in tokens (default 32768; 0 = no checkpoints)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="KV and conv-state dtype (default: what `serve` would allocate: the checkpoint's dtype when "
        "--config is a checkpoint directory, else float32 as for random weights)",
    )
    p.add_argument(
        "--hbm",
        type=float,
        default=None,
        help="accelerator memory in GB (1e9 bytes): report how many sequences of this length fit",
    )
    add_checkpoint_dtype_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)

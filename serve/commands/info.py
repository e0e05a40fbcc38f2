"""`jaxhybrid info`: parameter counts and per-sequence cache bytes of a config, from shapes only."""

from __future__ import annotations

import argparse
import json
import sys

from serve.commands.common import DTYPES, add_config_arg, fmt_bytes, fmt_count


def run(args: argparse.Namespace) -> int:
    """Parameter counts and per-sequence cache bytes of a config, from shapes only."""
    import jax.numpy as jnp

    from jaxhybrid.cache import cache_bytes_per_sequence
    from jaxhybrid.config import ConfigError, load_config
    from jaxhybrid.counting import count_params

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(args.dtype)
    counts = count_params(cfg, dtype)
    cache = cache_bytes_per_sequence(cfg, args.context, dtype)
    out = {
        **counts,
        "layers": cfg.num_hidden_layers,
        "kda_layers": cfg.num_kda_layers,
        "mla_layers": cfg.num_mla_layers,
        "cache_per_sequence": cache,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"config {cfg.name}: {cfg.num_hidden_layers} layers ({cfg.num_kda_layers} KDA, "
        f"{cfg.num_mla_layers} MLA), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}"
    )
    if counts["approximate"]:
        print(f"  note: approximate, not implemented yet: {', '.join(counts['unimplemented'])}")
    rows = [
        ("total parameters", f"{counts['total_params']:,}", fmt_count(counts["total_params"])),
        ("active parameters / token", f"{counts['active_params']:,}", fmt_count(counts["active_params"])),
        (
            "  without embedding table",
            f"{counts['active_params_without_embedding']:,}",
            fmt_count(counts["active_params_without_embedding"]),
        ),
        (
            "routed expert parameters",
            f"{counts['routed_expert_params']:,}",
            fmt_count(counts["routed_expert_params"]),
        ),
        (f"parameter bytes ({args.dtype})", f"{counts['param_bytes']:,}", fmt_bytes(counts["param_bytes"])),
        (f"MLA latent KV @ {args.context} tokens", f"{cache['kv_bytes']:,}", fmt_bytes(cache["kv_bytes"])),
        ("KDA state (recurrent fp32 + conv)", f"{cache['state_bytes']:,}", fmt_bytes(cache["state_bytes"])),
        ("cache per sequence", f"{cache['total_bytes']:,}", fmt_bytes(cache["total_bytes"])),
    ]
    width = max(len(r[0]) for r in rows)
    for name, exact, short in rows:
        print(f"  {name:<{width}}  {exact:>22}  {short:>10}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info", help="parameter counts and per-sequence cache bytes of a config", description=run.__doc__
    )
    add_config_arg(p, required=True)
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="parameter and KV-cache dtype for byte counts (default bfloat16); "
        "the KDA recurrent state is always fp32",
    )
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence for the cache bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)

"""The `jaxhybrid` command line (one entry point; subcommands are added by the issues that build them)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

DTYPES = ("bfloat16", "float32", "float16")


def _fmt_count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def cmd_info(args: argparse.Namespace) -> int:
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
        ("total parameters", f"{counts['total_params']:,}", _fmt_count(counts["total_params"])),
        ("active parameters / token", f"{counts['active_params']:,}", _fmt_count(counts["active_params"])),
        (
            "  without embedding table",
            f"{counts['active_params_without_embedding']:,}",
            _fmt_count(counts["active_params_without_embedding"]),
        ),
        (
            "routed expert parameters",
            f"{counts['routed_expert_params']:,}",
            _fmt_count(counts["routed_expert_params"]),
        ),
        (f"parameter bytes ({args.dtype})", f"{counts['param_bytes']:,}", _fmt_bytes(counts["param_bytes"])),
        (f"MLA latent KV @ {args.context} tokens", f"{cache['kv_bytes']:,}", _fmt_bytes(cache["kv_bytes"])),
        ("KDA state (recurrent fp32 + conv)", f"{cache['state_bytes']:,}", _fmt_bytes(cache["state_bytes"])),
        ("cache per sequence", f"{cache['total_bytes']:,}", _fmt_bytes(cache["total_bytes"])),
    ]
    width = max(len(r[0]) for r in rows)
    for name, exact, short in rows:
        print(f"  {name:<{width}}  {exact:>22}  {short:>10}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxhybrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "info", help="parameter counts and per-sequence cache bytes of a config", description=cmd_info.__doc__
    )
    p.add_argument(
        "--config",
        required=True,
        help="a name in configs/ (tiny, small, kimi-linear-48b-a3b, kimi-k3, ...), a YAML path, "
        "or a Hugging Face config.json / model directory",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="parameter and KV-cache dtype for byte counts (default bfloat16); "
        "the KDA recurrent state is always fp32",
    )
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence for the cache bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

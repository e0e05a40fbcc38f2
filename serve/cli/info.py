"""`jaxhybrid info`: parameter counts, checkpoint bytes and per-sequence cache bytes of a config, from shapes
only. With MXFP4 routed experts (`expert_quant: mxfp4`, Kimi K3) the checkpoint bytes count them at 4.25 bits
per weight (packed nibbles + one E8M0 scale byte per 32) and everything else at its dtype."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from serve.cli.common import add_config_arg
from serve.report import DTYPES, fmt_bytes, fmt_count

BUFFER_ITEMSIZE = 4  # the model's buffers (the router's score-correction bias) are fp32


def checkpoint_bytes(cfg: Any, counts: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """Bytes a checkpoint of `cfg` stores: routed experts at `itemsize` bytes per weight, or at 4.25 bits
    when `cfg.expert_quant == "mxfp4"`; every other parameter at its dtype (`counts["param_bytes"]`
    less the routed experts at `itemsize`); buffers fp32."""
    from jaxhybrid.weights.mxfp4 import GROUP

    quant = getattr(cfg, "expert_quant", None)
    routed = counts["routed_expert_params"]
    other = counts["param_bytes"] - routed * itemsize
    if quant == "mxfp4":
        # per weight [out, in] (in a multiple of 32): out*in/2 packed bytes + out*in/32 scale bytes
        routed_bytes = routed // 2 + routed // GROUP
    else:
        routed_bytes = routed * itemsize
    buffers = counts["buffer_elements"] * BUFFER_ITEMSIZE
    return {
        "expert_quant": quant,
        "routed_expert_bytes": routed_bytes,
        "other_param_bytes": other,
        "buffer_bytes": buffers,
        "total_bytes": routed_bytes + other + buffers,
    }


def run(args: argparse.Namespace) -> int:
    """Parameter counts and per-sequence cache bytes of a config, from shapes only."""
    import jax.numpy as jnp

    from jaxhybrid.cache import cache_bytes_per_sequence
    from jaxhybrid.config import ConfigError, load_config
    from jaxhybrid.counting import count_params
    from jaxhybrid.weights import CheckpointError
    from serve.models import checkpoint_dir, serving_dtype

    try:
        cfg = load_config(args.config)
        choice = serving_dtype(args.dtype, checkpoint_dir(args.config))
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(choice.dtype)
    counts = count_params(cfg, dtype)
    cache = cache_bytes_per_sequence(cfg, args.context, dtype)
    ckpt = checkpoint_bytes(cfg, counts, dtype.itemsize)
    out = {
        "dtype": choice.dtype,
        "dtype_reason": choice.reason,
        **counts,
        "checkpoint": ckpt,
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
    print(f"  counted in {choice.describe()}, as `serve` would allocate it")
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
        (f"parameter bytes ({choice.dtype})", f"{counts['param_bytes']:,}", fmt_bytes(counts["param_bytes"])),
    ]
    if ckpt["expert_quant"] == "mxfp4":
        rows += [
            (
                "routed experts, MXFP4 (4.25 bit)",
                f"{ckpt['routed_expert_bytes']:,}",
                fmt_bytes(ckpt["routed_expert_bytes"]),
            ),
            (
                f"other parameters ({choice.dtype} / fp32)",
                f"{ckpt['other_param_bytes']:,}",
                fmt_bytes(ckpt["other_param_bytes"]),
            ),
            ("checkpoint bytes (+ fp32 buffers)", f"{ckpt['total_bytes']:,}", fmt_bytes(ckpt["total_bytes"])),
        ]
    rows += [
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
        default=None,
        help="parameter and KV-cache dtype for byte counts (default: what `serve` would allocate: the "
        "checkpoint's dtype when --config is a checkpoint directory, else float32 as for random weights); "
        "the KDA recurrent state is always fp32",
    )
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence for the cache bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)

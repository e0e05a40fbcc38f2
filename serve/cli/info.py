"""`jaxhybrid info`: parameter counts, checkpoint bytes and per-sequence cache bytes of a config, from shapes
only; `--model DIR` loads a checkpoint and adds the bytes the model holds (MXFP4 experts packed unless
`--dequantize-experts`) beside the analytic count. With MXFP4 routed experts (`expert_quant: mxfp4`, Kimi
K3) the checkpoint bytes count them at 4.25 bits per weight (packed nibbles + one E8M0 scale byte per 32)
and everything else at its dtype."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxhybrid.cache import cache_bytes_per_sequence
from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.counting import count_params
from jaxhybrid.model import held_bytes
from jaxhybrid.weights import CheckpointError, load_pretrained
from jaxhybrid.weights.mxfp4 import GROUP
from serve.cli.common import add_config_arg
from serve.models import add_dequantize_experts_arg, checkpoint_dir, serving_dtype
from serve.report import DTYPES, fmt_bytes, fmt_count

BUFFER_ITEMSIZE = 4  # the model's buffers (the router's score-correction bias) are fp32


def checkpoint_bytes(cfg: Any, counts: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """Bytes a checkpoint of `cfg` stores: routed experts at `itemsize` bytes per weight, or at 4.25 bits
    when `cfg.expert_quant == "mxfp4"`; every other parameter at its dtype (`counts["param_bytes"]`
    less the routed experts at `itemsize`); buffers fp32."""
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


def model_report(args: argparse.Namespace, dtype: str) -> tuple[Any, dict[str, Any]]:
    """(the config, what the loaded --model holds): its arrays' bytes as held (MXFP4 experts packed unless
    --dequantize-experts), loaded in `dtype` as `serve` loads it, against the analytic count of its config at
    that dtype."""
    import jax.numpy as jnp

    model = load_pretrained(
        args.model,
        dtype=jnp.dtype(dtype),
        progress=False,
        dequantize_experts=args.dequantize_experts,
    )
    cfg = model.config
    dtype = jnp.dtype(model.model.embed_tokens.weight[...].dtype)
    counted = cfg if model.packed_experts else cfg.replace(expert_quant=None)
    analytic = checkpoint_bytes(counted, count_params(counted, dtype), dtype.itemsize)["total_bytes"]
    held = held_bytes(model)
    return cfg, {
        "path": str(args.model),
        "dtype": dtype.name,
        "packed_experts": bool(model.packed_experts),
        "held_bytes": held,
        "analytic_bytes": analytic,
        "held_over_analytic": held / analytic,
    }


def run(args: argparse.Namespace) -> int:
    """Parameter counts and per-sequence cache bytes of a config, from shapes only; with --model, also the
    bytes the loaded model holds."""
    import jax.numpy as jnp

    loaded = None
    try:
        if args.model:
            choice = serving_dtype(args.dtype, args.model)
            cfg, loaded = model_report(args, choice.dtype)
        else:
            cfg = load_config(args.config)
            choice = serving_dtype(args.dtype, checkpoint_dir(args.config))
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(choice.dtype)  # a --model is loaded in it too
    counts = count_params(cfg, dtype)
    context = args.context or cfg.max_position_embeddings  # the model's own context unless asked
    cache = cache_bytes_per_sequence(cfg, context, dtype)
    ckpt = checkpoint_bytes(cfg, counts, dtype.itemsize)
    out = {
        "dtype": choice.dtype,
        "dtype_reason": choice.reason,
        **counts,
        "checkpoint": ckpt,
        "layers": cfg.num_hidden_layers,
        "kda_layers": cfg.num_kda_layers,
        "mla_layers": cfg.num_mla_layers,
        "context": context,
        "cache_per_sequence": cache,
    }
    if loaded:
        out["model"] = loaded
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
    print_rows(table_rows(counts, ckpt, cache, loaded, context, dtype.name))
    return 0


def table_rows(
    counts: dict[str, Any],
    ckpt: dict[str, Any],
    cache: dict[str, Any],
    loaded: dict[str, Any] | None,
    context: int,
    dtype: str,
) -> list[tuple[str, str, str]]:
    """The text table: (name, exact number, short form) per row."""
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
        (f"parameter bytes ({dtype})", f"{counts['param_bytes']:,}", fmt_bytes(counts["param_bytes"])),
    ]
    if ckpt["expert_quant"] == "mxfp4":
        rows += [
            (
                "routed experts, MXFP4 (4.25 bit)",
                f"{ckpt['routed_expert_bytes']:,}",
                fmt_bytes(ckpt["routed_expert_bytes"]),
            ),
            (
                f"other parameters ({dtype} / fp32)",
                f"{ckpt['other_param_bytes']:,}",
                fmt_bytes(ckpt["other_param_bytes"]),
            ),
            ("checkpoint bytes (+ fp32 buffers)", f"{ckpt['total_bytes']:,}", fmt_bytes(ckpt["total_bytes"])),
        ]
    if loaded:
        how = "packed experts" if loaded["packed_experts"] else "dense experts"
        rows += [
            (f"model holds ({how})", f"{loaded['held_bytes']:,}", fmt_bytes(loaded["held_bytes"])),
            ("  analytic count", f"{loaded['analytic_bytes']:,}", f"{loaded['held_over_analytic']:.4f}x"),
        ]
    rows += [
        (f"MLA latent KV @ {context} tokens", f"{cache['kv_bytes']:,}", fmt_bytes(cache["kv_bytes"])),
        ("KDA state (recurrent fp32 + conv)", f"{cache['state_bytes']:,}", fmt_bytes(cache["state_bytes"])),
        ("cache per sequence", f"{cache['total_bytes']:,}", fmt_bytes(cache["total_bytes"])),
    ]
    return rows


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    for name, exact, short in rows:
        print(f"  {name:<{width}}  {exact:>22}  {short:>10}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info", help="parameter counts and per-sequence cache bytes of a config", description=run.__doc__
    )
    src = p.add_mutually_exclusive_group(required=True)
    add_config_arg(src)
    src.add_argument(
        "--model",
        help="a checkpoint directory: load it and also report the bytes the model holds (its arrays) "
        "against the analytic count",
    )
    add_dequantize_experts_arg(p)
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="parameter and KV-cache dtype for byte counts (default: what `serve` would allocate: the "
        "checkpoint's dtype for --model or when --config is a checkpoint directory, else float32 as for "
        "random weights); "
        "the KDA recurrent state is always fp32",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per sequence for the cache bytes (default: the model's own context, "
        "max_position_embeddings)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)

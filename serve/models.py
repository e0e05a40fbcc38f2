"""Model loading shared by the commands and the benchmarks: `--model` / `--config` / the shipped model,
placed on the `--mesh` when one is given."""

from __future__ import annotations

import argparse
from typing import Any


class UsageError(ValueError):
    """Bad command-line input; printed as `error: ...` with exit status 2."""


def add_dequantize_experts_arg(p: Any) -> None:
    """`--dequantize-experts`, for every command that loads a model (`load_model` reads it)."""
    p.add_argument(
        "--dequantize-experts",
        action="store_true",
        help="hold MXFP4 routed experts dequantized (3.6x their bytes at bf16) instead of packed",
    )


def load_model(args: argparse.Namespace) -> Any:
    """The model named by --model / --config (random weights from --seed for a config). With neither, the
    shipped model (`jaxhybrid.assets`): `args.model` is set to its directory, so its tokenizer is used.
    MXFP4 experts stay packed unless --dequantize-experts."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxhybrid.assets import shipped_model_dir
    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM

    dq = getattr(args, "dequantize_experts", False)
    if not args.model and not args.config and shipped_model_dir() is not None:
        args.model = str(shipped_model_dir())
    if args.model:
        if args.config:
            raise UsageError("give either --model DIR or --config NAME, not both")
        from jaxhybrid.weights import load_pretrained

        return load_pretrained(args.model, dtype=jnp.dtype(args.dtype), progress=False, dequantize_experts=dq)
    cfg = load_config(args.config or "tiny")
    return HybridLM(cfg, rngs=nnx.Rngs(args.seed), dtype=jnp.dtype(args.dtype), dequantize_experts=dq)


def make_mesh(spec: str | None) -> Any:
    """The `--mesh` device mesh (None when unset or one device); MeshSpecError names what does not fit."""
    if spec is None or not spec.strip():
        return None
    from sharding.mesh import mesh_from_flag

    mesh = mesh_from_flag(spec)
    return None if mesh.devices.size == 1 else mesh


def load_on_mesh(args: argparse.Namespace, multi: bool) -> tuple[Any, Any]:
    """(the model of `load_model`, the `--mesh` mesh or None), its parameters sharded over the mesh;
    several processes (`multi`) need a mesh over the devices of all of them."""
    mesh = make_mesh(args.mesh)
    if multi and mesh is None:
        raise UsageError(
            "several processes need --mesh over the devices of all of them "
            "(e.g. --mesh data=2,expert=2,tensor=2)"
        )
    model = load_model(args)
    if mesh is not None:
        from sharding.placement import shard_model

        shard_model(model, mesh)  # expert parallelism installed where the expert axis divides the experts
    return model, mesh

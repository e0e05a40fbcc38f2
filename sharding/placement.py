"""The model on a device mesh: create parameters in their shardings, shard an existing model, install
expert parallelism, restore a checkpoint onto a mesh, and the shardings of the engine's cache pools.

`serve` may import both `jaxhybrid` and `sharding`; this module is where they meet.

Engine integration (``--mesh``): ``mesh = sharding.mesh.mesh_from_flag(spec)`` (after
``sharding.multihost.initialize(settings)`` on several hosts); the model from
`create_sharded_model` / `load_sharded_model` / `shard_model` (expert parallelism installed when the
expert axis divides num_experts); the pools created with ``jax.jit(zeros, out_shardings=pool_shardings(
...))`` and passed to the jitted step with the same in/out shardings (donated, so they stay in place);
per-sequence inputs (tokens, slot ids, block tables, lengths) with `sharding.rules.batch_sharding`.
``max_slots`` divisible by data*expert gives every (data, expert) device its own slots; otherwise the
rules fall back to data only or replicated (still correct).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxhybrid.cache import KDACache
from jaxhybrid.config import ModelConfig
from jaxhybrid.model import HybridLM, TraceRngs, abstract_model, set_experts_fn
from jaxhybrid.weights import load_pretrained
from sharding.checkpoint import restore_state
from sharding.expert_parallel import make_expert_parallel_fn
from sharding.rules import LogicalRules, cache_shardings, state_shardings


def wants_expert_parallel(cfg: ModelConfig, mesh: Mesh) -> bool:
    """Expert parallelism applies when the mesh has an expert axis > 1 that divides num_experts."""
    ep = mesh.shape.get("expert", 1)
    return cfg.num_moe_layers > 0 and ep > 1 and cfg.num_experts % ep == 0


def install_expert_parallel(model: HybridLM, mesh: Mesh, exchange: str = "auto") -> None:
    """Route every MoE layer through the expert-parallel dispatch of `sharding.expert_parallel`."""
    set_experts_fn(model, make_expert_parallel_fn(mesh, exchange=exchange))


def _maybe_install(model: HybridLM, mesh: Mesh, expert_parallel: bool | str | None) -> None:
    """None: install when `wants_expert_parallel`; False: never; True or an exchange name: always."""
    if expert_parallel is None:
        expert_parallel = wants_expert_parallel(model.config, mesh)
    if expert_parallel:
        install_expert_parallel(model, mesh, "auto" if expert_parallel is True else expert_parallel)


def create_sharded_model(
    cfg: ModelConfig,
    mesh: Mesh,
    seed: int = 0,
    dtype: Any = jnp.float32,
    *,
    rules: LogicalRules | None = None,
    expert_parallel: bool | str | None = None,
) -> HybridLM:
    """A freshly initialised HybridLM whose parameters are created directly in their shardings.

    The initialiser runs under `jax.jit` with `out_shardings` from `state_shardings`, so each device
    computes only its own shards (no full copy anywhere; works across processes). Values equal
    `HybridLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype)` (same random streams). `expert_parallel`: see
    `_maybe_install` (default: on when the mesh has an expert axis that divides num_experts)."""
    abstract = abstract_model(cfg, dtype, seed)
    graphdef, _ = nnx.split(abstract)
    shardings = state_shardings(abstract, mesh, rules)

    def init() -> nnx.State:
        return nnx.state(HybridLM(cfg, rngs=TraceRngs(seed), dtype=dtype))  # type: ignore[arg-type]

    state = jax.jit(init, out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    _maybe_install(model, mesh, expert_parallel)
    return model


def _put(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Place a value held (whole) by this process onto a possibly multi-process sharding."""
    if isinstance(value, jax.Array) and value.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(
    model: HybridLM,
    mesh: Mesh,
    *,
    rules: LogicalRules | None = None,
    expert_parallel: bool | str | None = None,
) -> HybridLM:
    """Move an existing model's parameters onto `mesh` in place (and return it)."""
    shardings = state_shardings(model, mesh, rules)
    state = jax.tree.map(_put, nnx.state(model), shardings)
    nnx.update(model, state)
    _maybe_install(model, mesh, expert_parallel)
    return model


def load_sharded_model(
    path: str | os.PathLike[str],
    cfg: ModelConfig,
    mesh: Mesh,
    dtype: Any = jnp.float32,
    *,
    rules: LogicalRules | None = None,
    expert_parallel: bool | str | None = None,
) -> HybridLM:
    """A model restored from an Orbax checkpoint of `sharding.checkpoint.save_state`, saved from any mesh,
    directly into its shardings on `mesh`."""
    abstract = abstract_model(cfg, dtype)
    graphdef, _ = nnx.split(abstract)
    model = nnx.merge(graphdef, restore_state(path, abstract, mesh, rules))
    _maybe_install(model, mesh, expert_parallel)
    return model


def pool_shardings(
    cfg: ModelConfig,
    mesh: Mesh,
    *,
    slots: int,
    num_blocks: int,
    block_size: int,
    rules: LogicalRules | None = None,
) -> tuple[Any, ...]:
    """Shardings in the exact pytree of `Engine.pools`: `KDACache(conv, state)` per KDA layer and one
    NamedSharding per MLA latent pool. Use as `out_shardings` when creating the pools and as the pools'
    in/out shardings of the engine's jitted programs."""
    per_layer = cache_shardings(
        cfg, mesh, slots=slots, num_blocks=num_blocks, block_size=block_size, rules=rules
    )
    return tuple(
        KDACache(conv=s["conv"], state=s["state"]) if kind == "kda" else s["pool"]
        for kind, s in zip(cfg.layer_types, per_layer, strict=True)
    )


def load_pretrained_on_mesh(
    path: str | os.PathLike[str],
    mesh: Mesh,
    dtype: Any = None,
    *,
    rules: LogicalRules | None = None,
    expert_parallel: bool | str | None = None,
    **kw: Any,
) -> HybridLM:
    """`jaxhybrid.weights.load_pretrained` with every parameter read straight into its sharding on `mesh`:
    from safetensors each process reads only its own devices' shards (byte ranges), no whole tensor on any
    device or host unless one device holds it whole; an Orbax directory restores onto the shardings but
    each process reads every array whole (one stored chunk per array). `expert_parallel`: as in
    `shard_model` (default: installed when the expert axis divides num_experts)."""
    model = load_pretrained(
        path, dtype, shardings=lambda abstract: state_shardings(abstract, mesh, rules), **kw
    )
    _maybe_install(model, mesh, expert_parallel)
    return model

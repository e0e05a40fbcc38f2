"""Logical axis names -> mesh axes: one rules table for parameters, caches and activations.

Every parameter and buffer of the model carries one logical name (or None) per dimension in its Flax
``out_sharding`` metadata (see `jaxhybrid.layers.basic.param`). `RULES` maps each name to a mesh axis, a
tuple of mesh axes, or None (replicated):

    logical name    mesh axes          dimensions
    --------------  -----------------  ------------------------------------------------------------------
    vocab           tensor             embedding and lm_head rows
    embed           -                  the hidden size everywhere (activations stay whole on it), incl.
                                       the K3 AttnRes vectors (*_res_norm [D], *_res_proj [1, D])
    heads           tensor             MLA head-major dims: q_proj/q_b_proj/kv_b_proj/g_proj rows, o_proj
                                       cols
    kda_heads       tensor             KDA head-major dims: q/k/v/f_b/g_b/g_proj/b_proj rows, conv
                                       channels, dt_bias, A_log heads (unpadded), o_proj cols; heads of
                                       the KDA pools
    kda_head_dim    -                  KDA d-wide gate ranks (f_a/g_a rows), o_norm weight
    q_lora          -                  MLA query low rank
    kv_latent       -                  MLA latent (kv_lora_rank + rope): kv_a_proj rows, kv_b_proj cols,
                                       kv_a_layernorm, the latent axis of the paged KV pool
    mlp             tensor             dense and shared-expert intermediate size
    experts         expert             the stacked routed experts (w1/w2/w3 dim 0)
    expert_mlp      tensor             routed experts' intermediate size (2-D expert x tensor split)
    moe_latent      -                  K3 latent MoE width: routed_expert_down_proj rows, up_proj cols,
                                       routed_expert_norm, the experts' in/out dim (like `embed`)
    router          -                  router rows and the score-correction bias (all E scores per token)
    batch           (data, expert)     sequences of a batch (tokens, logits, block tables, lengths)
    slots           (data, expert)     the engine's slot axis of the KDA conv/state pools
    kv_blocks       -                  the paged MLA pool's block axis
    block           -                  positions inside one KV block

Where the MLA latent goes: nowhere (replicated over ``tensor`` and ``expert``). The latent is shared by
all heads (it is MQA-like: one compressed "KV head" that every query head reads, either expanded through
kv_b_proj or absorbed), so a tensor rank that holds some heads needs the whole latent of every position
it attends. Splitting the latent dimension would turn each attention step into partial scores plus a
psum over ``tensor`` per layer and position; replicating it costs memory instead, which is the standard
trade for MLA (DP-attention serving keeps one full latent cache per tensor group). The pool's block axis
is replicated as well because the engine has one global block allocator: a sequence's blocks can be
anywhere in the pool. Mapping ``kv_blocks -> data`` (pass ``rules``) pays off only once the allocator
hands each data shard blocks from its own range.

Batch and slots use ``(data, expert)``: the expert axis holds different experts but the same attention
weights, so it doubles as a data axis for everything outside the MoE (attention runs on different
sequences there, instead of repeating the same work). The expert-parallel MoE takes its tokens split
over the same two axes.

Divisibility fallback: a dimension is split over its mesh axes only if its size (and, for ``heads`` /
``kda_heads``, the number of heads, so that shards fall on head boundaries; for a parameter with
``shard_units`` metadata, its units, e.g. MXFP4 experts' F/32 scale groups, so that codes and scales split
together and w1/w3/w2 split F alike) is divisible by the product of their sizes. For a tuple of axes the
longest prefix that divides is used (``(data, expert)`` falls back to ``(data,)``), otherwise the
dimension is replicated. A mesh axis is used at most once per array (a later dimension that maps to an
axis already used is replicated). The result is always a correct placement; a replicated fallback only
costs memory (e.g. the 2-head tiny model on ``tensor=4`` keeps its attention weights whole on every tensor
rank and splits vocab and MLP widths only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxhybrid.config import ModelConfig

MeshAxes = str | tuple[str, ...] | None
LogicalRules = Mapping[str, MeshAxes]

RULES: dict[str, MeshAxes] = {
    "vocab": "tensor",
    "embed": None,
    "heads": "tensor",
    "kda_heads": "tensor",
    "kda_head_dim": None,
    "q_lora": None,
    "kv_latent": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "moe_latent": None,
    "router": None,
    "batch": ("data", "expert"),
    "slots": ("data", "expert"),
    "kv_blocks": None,
    "block": None,
}

# Logical names of the serving caches (engine pools), per dimension.
KDA_CONV_POOL_AXES = ("slots", "kda_heads", None)  # [slots, 3*H*d, K-1]
KDA_STATE_POOL_AXES = ("slots", "kda_heads", None, None)  # [slots, H, d, d]
MLA_POOL_AXES = ("kv_blocks", "block", "kv_latent")  # [num_blocks, block_size, kv_lora_rank + rope]


def logical_units(cfg: ModelConfig | None) -> dict[str, int]:
    """Logical names whose dimension is a whole number of units (heads) that a shard must not split."""
    if cfg is None:
        return {}
    return {"heads": cfg.num_attention_heads, "kda_heads": cfg.kda_num_heads}


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: LogicalRules | None = None,
    units: Mapping[str, int] | None = None,
    dim_units: Sequence[int | None] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dimensions have logical `names`.

    Unknown names raise KeyError (a typo must not silently replicate). Divisibility fallback as documented
    in the module docstring. `dim_units` (per dimension, optional): a dimension of that many indivisible
    units splits only on their boundaries (MXFP4 experts: the scale groups of F)."""
    rules = RULES if rules is None else rules
    units = units or {}
    if names is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(
            f"{len(names)} logical axis names {tuple(names)} for an array of shape {tuple(shape)}"
        )
    used: set[str] = set()
    spec: list[Any] = []
    per_dim = (None,) * len(shape) if dim_units is None else tuple(dim_units)
    for name, size, dim_unit in zip(names, shape, per_dim, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis '{name}' has no rule (known: {', '.join(sorted(rules))})")
        wanted = [a for a in _as_tuple(rules[name]) if a in mesh.shape and a not in used]
        chosen: tuple[str, ...] = ()
        for n in range(len(wanted), 0, -1):
            prefix = tuple(wanted[:n])
            ways = int(np.prod([mesh.shape[a] for a in prefix]))
            whole = units.get(name, ways) % ways == 0 and (dim_unit or ways) % ways == 0
            if size % ways == 0 and whole:
                chosen = prefix
                break
        chosen = tuple(a for a in chosen if mesh.shape[a] > 1)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_sharding(
    names: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: LogicalRules | None = None,
    units: Mapping[str, int] | None = None,
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules, units))


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable carries (Flax `out_sharding` metadata), or None."""
    names = var.get_metadata("out_sharding", None)
    return None if names is None else tuple(names)


def _model_config(model: Any) -> ModelConfig | None:
    cfg = getattr(model, "config", None)
    return cfg if isinstance(cfg, ModelConfig) else None


def partition_specs(abstract_model: nnx.Module, mesh: Mesh, rules: LogicalRules | None = None) -> nnx.State:
    """nnx.state(abstract_model) with a PartitionSpec in place of each value."""
    units = logical_units(_model_config(abstract_model))

    def spec(var: Any) -> Any:
        value = var.get_value()
        if not hasattr(value, "shape"):
            return var.replace(PartitionSpec())
        dim_units = var.get_metadata("shard_units", None)
        return var.replace(logical_to_spec(variable_axes(var), value.shape, mesh, rules, units, dim_units))

    return _map_variables(spec, nnx.state(abstract_model))


def state_shardings(abstract_model: nnx.Module, mesh: Mesh, rules: LogicalRules | None = None) -> nnx.State:
    """Same structure as `nnx.state(abstract_model)`, a NamedSharding in place of each value.

    `abstract_model` may be abstract (`nnx.eval_shape`) or concrete; only shapes and metadata are read. The
    result serves as `out_shardings` of a jitted init, as `jax.device_put` target, and for Orbax restore."""
    return _map_variables(
        lambda v: v.replace(NamedSharding(mesh, v.get_value())), partition_specs(abstract_model, mesh, rules)
    )


def _map_variables(fn: Any, state: nnx.State) -> nnx.State:
    return jax.tree.map(fn, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def cache_shardings(
    cfg: ModelConfig,
    mesh: Mesh,
    *,
    slots: int,
    num_blocks: int,
    block_size: int,
    rules: LogicalRules | None = None,
) -> tuple[dict[str, NamedSharding], ...]:
    """Shardings of the engine's pools, one dict per layer in layer order.

    KDA layers: ``{"conv": [slots, 3*H*d, K-1], "state": [slots, H, d, d]}`` (slots on (data, expert),
    heads/channels on tensor). MLA layers: ``{"pool": [num_blocks, block_size, latent]}`` (replicated, see
    the module docstring). Plain dicts because `sharding` may not import the cache types; the engine
    wraps them (`sharding.placement.pool_shardings` builds the engine's exact pool pytree)."""
    units = logical_units(cfg)
    conv_shape = (slots, 3 * cfg.kda_proj_dim, cfg.short_conv_kernel_size - 1)
    state_shape = (slots, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    pool_shape = (num_blocks, block_size, cfg.latent_dim)
    out: list[dict[str, NamedSharding]] = []
    for kind in cfg.layer_types:
        if kind == "kda":
            out.append(
                {
                    "conv": logical_sharding(KDA_CONV_POOL_AXES, conv_shape, mesh, rules, units),
                    "state": logical_sharding(KDA_STATE_POOL_AXES, state_shape, mesh, rules, units),
                }
            )
        else:
            out.append({"pool": logical_sharding(MLA_POOL_AXES, pool_shape, mesh, rules, units)})
    return tuple(out)


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: LogicalRules | None = None) -> NamedSharding:
    """Sharding of a per-sequence array [B, ...] (tokens, logits, block tables, lengths): B on `batch`."""
    return logical_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

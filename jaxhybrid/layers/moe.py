"""Mixture of experts: sigmoid router with score correction bias, routed SwiGLU experts, shared expert.

Checkpoint names: `block_sparse_moe.gate.weight`, `block_sparse_moe.gate.e_score_correction_bias`,
`block_sparse_moe.experts.E.{w1,w2,w3}.weight` (stacked here over E, each [out, in]),
`block_sparse_moe.shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import SwiGLU, buffer, linear_init, param
from jaxhybrid.ops.moe import moe_experts_dense, moe_experts_dropless, route

EXPERT_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "dropless": moe_experts_dropless,
    "dense": moe_experts_dense,
}


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # "router" (not "experts"): the router is tiny and every token needs all E scores for its top-k.
        self.weight = param(
            linear_init(rngs.params(), (cfg.num_experts, cfg.hidden_size), jnp.float32), ("router", "embed")
        )
        self.e_score_correction_bias = buffer(jnp.zeros((cfg.num_experts,), jnp.float32), ("router",))
        self.top_k, self.n_group, self.topk_group = (
            cfg.num_experts_per_token,
            cfg.num_expert_group,
            cfg.topk_group,
        )
        self.renormalize, self.scaling = cfg.moe_renormalize, cfg.routed_scaling_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        return route(
            x,
            self.weight[...],
            self.e_score_correction_bias[...],
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            scaling=self.scaling,
        )


class Experts(nnx.Module):
    """Routed experts stacked over E: w1, w3 [E, F, D]; w2 [E, D, F]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = param(linear_init(rngs.params(), (E, F, D), dtype), ("experts", "expert_mlp", "embed"))
        self.w2 = param(linear_init(rngs.params(), (E, D, F), dtype), ("experts", "embed", "expert_mlp"))
        self.w3 = param(linear_init(rngs.params(), (E, F, D), dtype), ("experts", "expert_mlp", "embed"))


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = (
            SwiGLU(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.num_shared_experts,
                rngs=rngs,
                dtype=dtype,
                hidden_axis="mlp",
            )
            if cfg.num_shared_experts > 0
            else None
        )
        self.impl = "dropless"  # "dense" runs every expert (the reference)
        # Optional replacement for EXPERT_IMPLS[self.impl] with the same signature (x, w1, w2, w3, weights,
        # ids) -> y, e.g. the expert-parallel dispatch of `sharding.expert_parallel`. A static attribute.
        self.experts_fn: Callable[..., jax.Array] | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        ex = self.experts
        experts_fn = self.experts_fn if self.experts_fn is not None else EXPERT_IMPLS[self.impl]
        y = experts_fn(
            flat,
            ex.w1[...].astype(x.dtype),
            ex.w2[...].astype(x.dtype),
            ex.w3[...].astype(x.dtype),
            weights,
            ids,
        )
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.reshape(shape)

"""Mixture of experts: sigmoid router with score correction bias, routed gated-MLP experts, shared expert.

Checkpoint names: `block_sparse_moe.gate.weight`, `block_sparse_moe.gate.e_score_correction_bias`,
`block_sparse_moe.experts.E.{w1,w2,w3}.weight` (stacked here over E, each [out, in]),
`block_sparse_moe.shared_experts.{gate,up,down}_proj.weight`.

Kimi K3's latent MoE (`routed_expert_hidden_size` L): the router and the shared experts see x, the routed
experts run in an L-wide latent, `z = routed_expert_down_proj(x)` [L, D]; their weighted sum is normalised
once (`routed_expert_norm` [L], when `latent_moe_use_norm`) and projected back by `routed_expert_up_proj`
[D, L]. The gated activation (SiLU or SiTU) is the config's, for routed and shared experts alike.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Linear, RMSNorm, SwiGLU, buffer, gated_activation, linear_init, param
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
    """Routed experts stacked over E: w1, w3 [E, F, D]; w2 [E, D, F] (D = the latent width in K3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        E, D, F = cfg.num_experts, cfg.expert_dim, cfg.moe_intermediate_size
        dim = "embed" if cfg.routed_expert_hidden_size is None else "moe_latent"
        self.w1 = param(linear_init(rngs.params(), (E, F, D), dtype), ("experts", "expert_mlp", dim))
        self.w2 = param(linear_init(rngs.params(), (E, D, F), dtype), ("experts", dim, "expert_mlp"))
        self.w3 = param(linear_init(rngs.params(), (E, F, D), dtype), ("experts", "expert_mlp", dim))


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.act = gated_activation(cfg)
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype)
        self.shared_experts = (
            SwiGLU(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.num_shared_experts,
                rngs=rngs,
                dtype=dtype,
                hidden_axis="mlp",
                act=self.act,
            )
            if cfg.num_shared_experts > 0
            else None
        )
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            D, L = cfg.hidden_size, cfg.expert_dim
            self.routed_expert_down_proj = Linear(D, L, rngs=rngs, dtype=dtype, axes=("moe_latent", "embed"))
            self.routed_expert_up_proj = Linear(L, D, rngs=rngs, dtype=dtype, axes=("embed", "moe_latent"))
            self.routed_expert_norm = (
                RMSNorm(L, cfg.rms_norm_eps, dtype=dtype, axis="moe_latent")
                if cfg.latent_moe_use_norm
                else None
            )
        self.impl = "dropless"  # "dense" runs every expert (the reference)
        # Optional replacement for EXPERT_IMPLS[self.impl] with the same signature (x, w1, w2, w3, weights,
        # ids, *, act) -> y, e.g. the expert-parallel dispatch of `sharding.expert_parallel`. Static.
        self.experts_fn: Callable[..., jax.Array] | None = None

    def __call__(
        self, x: jax.Array, *, valid: jax.Array | None = None, return_load: bool = False
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x [..., D] -> y [..., D]; with `return_load`, (y, tokens routed to each expert [E] int32): the
        counts the aux-loss-free bias update balances (training only; the output is the same).

        `valid` [...] bool (optional): tokens that are not real (idle engine slots, padding) skip the routed
        experts; their output is the shared expert's alone, and only they may differ."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        ex = self.experts
        experts_fn = self.experts_fn if self.experts_fn is not None else EXPERT_IMPLS[self.impl]
        y = experts_fn(
            self.routed_expert_down_proj(flat) if self.latent else flat,
            ex.w1[...].astype(x.dtype),
            ex.w2[...].astype(x.dtype),
            ex.w3[...].astype(x.dtype),
            weights,
            ids,
            act=self.act,
            valid=None if valid is None else valid.reshape(-1),
        )
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if return_load:
            load = jnp.bincount(ids.reshape(-1), length=ex.w1.shape[0]).astype(jnp.int32)
            return y.reshape(shape), load
        return y.reshape(shape)

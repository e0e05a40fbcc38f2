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
from jaxhybrid.ops import int8
from jaxhybrid.ops.int8 import Int8
from jaxhybrid.ops.moe import moe_experts_dense, moe_experts_dropless, route
from jaxhybrid.ops.mxfp4 import GROUP, MXFP4, ExpertWeight, quantize

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
    """Routed experts stacked over E: w1, w3 [E, F, D]; w2 [E, D, F] (D = the latent width in K3).

    `packed` (MXFP4 experts kept packed): instead, uint8 `wK_packed` [E, out, in/2] and `wK_scale`
    [E, out, in/32] per projection, with the dense weight's logical axes; random init quantizes the dense
    random init. Their `expert_mlp` dim splits only on whole scale groups (`shard_units`: F/32 units), so
    codes and scales always shard together and w1/w3/w2 split F alike."""

    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32, packed: bool = False
    ):
        E, D, F = cfg.num_experts, cfg.expert_dim, cfg.moe_intermediate_size
        dim = "embed" if cfg.routed_expert_hidden_size is None else "moe_latent"
        self.num_experts, self.packed = E, packed
        shapes = {"w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)}
        axes = {
            "w1": ("experts", "expert_mlp", dim),
            "w2": ("experts", dim, "expert_mlp"),
            "w3": ("experts", "expert_mlp", dim),
        }
        for name in ("w1", "w2", "w3"):
            dense = linear_init(rngs.params(), shapes[name], dtype)
            if not packed:
                setattr(self, name, param(dense, axes[name]))
                continue
            q = quantize(dense)
            units = tuple(F // GROUP if a == "expert_mlp" else None for a in axes[name])
            setattr(self, f"{name}_packed", param(q.packed, axes[name], units=units))
            setattr(self, f"{name}_scale", param(q.scale, axes[name], units=units))

    def weights(self, dtype: jnp.dtype | None) -> tuple[ExpertWeight, ExpertWeight, ExpertWeight]:
        """(w1, w2, w3) for the expert ops: dense ones cast to `dtype` (None: as stored); packed ones as
        `MXFP4` and int8 ones as `Int8`, untouched (the ops dequantize only the experts they read, never a
        whole-layer copy)."""
        if self.is_int8:
            return tuple(  # type: ignore[return-value]
                Int8(getattr(self, n)[...], getattr(self, f"{n}_scale")[...]) for n in ("w1", "w2", "w3")
            )
        if self.packed:
            return tuple(  # type: ignore[return-value]
                MXFP4(getattr(self, f"{n}_packed")[...], getattr(self, f"{n}_scale")[...])
                for n in ("w1", "w2", "w3")
            )
        ws = self.w1[...], self.w2[...], self.w3[...]
        return ws if dtype is None else tuple(w.astype(dtype) for w in ws)  # type: ignore[return-value]

    @property
    def is_int8(self) -> bool:
        return not self.packed and self.w1[...].dtype == jnp.int8

    def to_int8(self) -> None:
        """Hold dense experts as int8 codes with a float32 scale per expert and output channel (in place);
        MXFP4-packed experts stay packed."""
        if self.packed or self.is_int8:
            return
        for name in ("w1", "w2", "w3"):
            axes = getattr(self, name).get_metadata()["out_sharding"]
            q = int8.quantize(getattr(self, name)[...])
            setattr(self, name, param(q.q, axes))
            setattr(self, f"{name}_scale", param(q.scale, axes[:2]))


class MoE(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32, packed: bool = False
    ):
        """`packed`: the routed experts are kept as MXFP4 (see `Experts`)."""
        self.act = gated_activation(cfg)
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, packed=packed)
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
            *ex.weights(x.dtype),
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
            load = jnp.bincount(ids.reshape(-1), length=ex.num_experts).astype(jnp.int32)
            return y.reshape(shape), load
        return y.reshape(shape)

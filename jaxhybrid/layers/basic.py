"""Thin NNX building blocks whose parameter names match the Hugging Face checkpoint tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.config import ModelConfig
from jaxhybrid.ops import dense, int8
from jaxhybrid.ops.activations import SILU, GatedActivation, gated_act
from jaxhybrid.ops.norms import gated_rms_norm, rms_norm

# Linear weights are stored [out, in] as in the checkpoint; fan-in is the last axis.
linear_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2)


class Buffer(nnx.Variable):
    """A non-trainable tensor that is part of the checkpoint (e.g. the router's score correction bias)."""


# Logical axis names: every parameter and buffer carries one name (or None) per dimension in the standard
# Flax `out_sharding` metadata, e.g. ("vocab", "embed"). They are plain strings; `sharding.rules` maps them
# to mesh axes. `eager_sharding=False` keeps Flax from trying to place the value on a mesh at creation:
# the model itself knows no mesh, so construction and numerics are unchanged.
Axes = tuple[str | None, ...]


def param(value: jax.Array, axes: Axes, units: tuple[int | None, ...] | None = None) -> nnx.Param:
    """An `nnx.Param` annotated with one logical axis name per dimension. `units` (optional, per dimension):
    a dimension made of that many indivisible units (MXFP4 scale groups) splits only on their boundaries
    (`shard_units` metadata, read by `sharding.rules`)."""
    if len(axes) != len(value.shape):
        raise ValueError(f"{len(axes)} logical axis names {axes} for a parameter of shape {value.shape}")
    if units is None:
        return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False, shard_units=tuple(units))


def buffer(value: jax.Array, axes: Axes) -> Buffer:
    """A `Buffer` annotated with one logical axis name per dimension."""
    if len(axes) != len(value.shape):
        raise ValueError(f"{len(axes)} logical axis names {axes} for a buffer of shape {value.shape}")
    return Buffer(value, out_sharding=tuple(axes), eager_sharding=False)


class Linear(nnx.Module):
    """`y = x @ weight.T` with weight [out, in], no bias. `axes`: logical names of (out, in).

    After `to_int8()` the weight is int8 codes with a float32 `weight_scale` [out] (weight-only int8,
    `jaxhybrid.ops.int8`); `dense_weight()` gives the float weight either way."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        axes: tuple[str | None, str | None] = (None, None),
    ):
        self.weight = param(linear_init(rngs.params(), (out_features, in_features), dtype), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.is_int8:
            return int8.matmul(x, self.codes()).astype(x.dtype)
        return dense.matmul(x, self.weight[...])  # the stored dtype decides the precision

    @property
    def is_int8(self) -> bool:
        return self.weight[...].dtype == jnp.int8

    def codes(self) -> int8.Int8:
        """The int8 codes and their scales (an int8 layer only)."""
        return int8.Int8(self.weight[...], self.weight_scale[...])

    def dense_weight(self, dtype: jnp.dtype) -> jax.Array:
        if self.is_int8:
            return int8.dequantize(self.codes(), dtype)
        return self.weight[...].astype(dtype)

    def to_int8(self) -> None:
        """Hold the weight as int8 codes and per-output-channel scales (in place)."""
        if self.is_int8:
            return
        axes = self.weight.get_metadata()["out_sharding"]
        q = int8.quantize(self.weight[...])
        self.weight = param(q.q, axes)
        self.weight_scale = param(q.scale, axes[:1])


def project(x: jax.Array, *layers: Linear) -> tuple[jax.Array, ...]:
    """`x` through several `Linear` layers of the same input, `tuple(l(x) for l in layers)`: one kernel call
    for all of them where they are all int8 or all float (`matmul_many`: a decode step's projections split
    over the threads as one product, not each on its own)."""
    if all(layer.is_int8 for layer in layers):
        return tuple(y.astype(x.dtype) for y in int8.matmul_many(x, [layer.codes() for layer in layers]))
    if not any(layer.is_int8 for layer in layers):
        return dense.matmul_many(x, [layer.weight[...] for layer in layers])
    return tuple(layer(x) for layer in layers)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.weight = param(
            nnx.initializers.normal(0.02)(rngs.params(), (vocab, dim), dtype), ("vocab", "embed")
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32, axis: str | None = "embed"):
        self.weight = param(jnp.ones((dim,), dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...].astype(x.dtype), self.eps)


class GatedRMSNorm(nnx.Module):
    """Per-head RMSNorm multiplied by sigmoid(gate) (KDA `o_norm`)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32, axis: str | None = None):
        self.weight = param(jnp.ones((dim,), dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gated_rms_norm(x, gate, self.weight[...].astype(x.dtype), self.eps)


class DepthwiseConv(nnx.Module):
    """Holds a depthwise causal conv weight [channels, 1, kernel] (applied by `ops.conv`)."""

    def __init__(
        self,
        channels: int,
        kernel: int,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        axis: str | None = None,
    ):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "uniform", in_axis=-1, out_axis=0)
        self.weight = param(init(rngs.params(), (channels, 1, kernel), dtype), (axis, None, None))


def gated_activation(cfg: ModelConfig) -> GatedActivation:
    """The gated-MLP activation a config asks for: SiLU, or SiTU with its betas (K3)."""
    if cfg.hidden_act == "silu":
        return SILU
    beta = 1.0 if cfg.activation_situ_beta is None else float(cfg.activation_situ_beta)
    linear = None if cfg.activation_situ_linear_beta is None else float(cfg.activation_situ_linear_beta)
    return GatedActivation("situ", beta, linear)


class SwiGLU(nnx.Module):
    """Dense gated MLP `down(act(gate(x), up(x)))` (checkpoint `mlp.{gate,up,down}_proj`); `act` is SiLU
    (`silu(gate) * up`, the SwiGLU) unless a K3 config asks for SiTU."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        hidden_axis: str | None = "mlp",
        act: GatedActivation = SILU,
    ):
        self.gate_proj = Linear(dim, hidden, rngs=rngs, dtype=dtype, axes=(hidden_axis, "embed"))
        self.up_proj = Linear(dim, hidden, rngs=rngs, dtype=dtype, axes=(hidden_axis, "embed"))
        self.down_proj = Linear(hidden, dim, rngs=rngs, dtype=dtype, axes=("embed", hidden_axis))
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(gated_act(*project(x, self.gate_proj, self.up_proj), self.act))

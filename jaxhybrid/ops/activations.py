"""Gated-MLP activations: how a gated MLP combines its gate `g` and up `u` projections.

* SiLU (Kimi Linear): ``silu(g) * u``, in the operands' dtype.
* SiTU (Kimi K3): in fp32, ``a = beta * tanh(g / beta) * sigmoid(g)`` and ``u' = beta_L * tanh(u / beta_L)``
  (``u' = u`` when ``beta_L`` is None); the product ``a * u'`` is cast back to the operands' dtype. The
  tanh soft-caps both branches (the gate at ``beta``, the up projection at ``beta_L``).

An activation is a small frozen (hashable) value, so it can be a static attribute of a module and a static
argument of every expert implementation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["GatedActivation", "SILU", "gated_act"]


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """`kind` "silu" or "situ"; `beta` (gate cap) and `linear_beta` (up cap, None = no cap) are SiTU's."""

    kind: str = "silu"
    beta: float = 1.0
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"gated activation must be 'silu' or 'situ', got {self.kind!r}")
        if self.kind == "situ" and not self.beta > 0:
            raise ValueError(f"SiTU beta must be positive, got {self.beta!r}")
        if self.linear_beta is not None and not self.linear_beta > 0:
            raise ValueError(f"SiTU linear beta must be positive or None, got {self.linear_beta!r}")


SILU = GatedActivation()


def gated_act(gate: jax.Array, up: jax.Array, act: GatedActivation = SILU) -> jax.Array:
    """The hidden activation `act(gate, up)` of a gated MLP, in the result dtype of gate and up."""
    if act.kind == "silu":
        return jax.nn.silu(gate) * up
    dtype = jnp.result_type(gate.dtype, up.dtype)
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    a = act.beta * jnp.tanh(g / act.beta) * jax.nn.sigmoid(g)
    if act.linear_beta is not None:
        u = act.linear_beta * jnp.tanh(u / act.linear_beta)
    return (a * u).astype(dtype)

"""Attention residuals (Kimi K3 "AttnRes"): a learned per-token softmax over earlier residual partial sums.

The residual stream of a K3 model is a list of "blocks" (partial sums closed every `attn_res_block_size`
layers) plus the current partial sum `p`. Before each mixer, each FFN and the final norm, the stream is read
as a mix of those vectors::

    V = [B_1, ..., B_k, p]                      (k + 1 vectors of size D, fp32)
    K_i = V_i / sqrt(mean(V_i^2) + eps)         (RMS-normalised keys, no weight)
    s_i = <K_i, w>,  w = norm_weight * proj_weight
    out = sum_i softmax(s)_i V_i                (raw values), cast back to p's dtype

It acts within one token (nothing crosses positions), so it changes no cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["attn_res_mix"]


def attn_res_mix(
    partial: jax.Array,
    blocks: Sequence[jax.Array],
    norm_weight: jax.Array,
    proj_weight: jax.Array,
    eps: float,
) -> jax.Array:
    """Mix `blocks` (each [..., D]) and `partial` [..., D] per token; returns [..., D] in partial.dtype.

    norm_weight: [D] (the `*_res_norm.weight`); proj_weight: [1, D] or [D] (the `*_res_proj.weight`).
    Computed elementwise in fp32 (no matmul, so no reduced-precision matmul passes on accelerators).
    """
    if not blocks:
        raise ValueError("attn_res_mix needs at least one block besides the partial sum")
    v = jnp.stack([b.astype(jnp.float32) for b in blocks] + [partial.astype(jnp.float32)], axis=0)
    keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    w = norm_weight.astype(jnp.float32).reshape(-1) * proj_weight.astype(jnp.float32).reshape(-1)
    scores = jnp.sum(keys * w, axis=-1)  # [k + 1, ...]
    probs = jax.nn.softmax(scores, axis=0)
    return jnp.sum(probs[..., None] * v, axis=0).astype(partial.dtype)

"""Stacks of matrices (experts [E, ...], layer groups [G, E, ...]): one matrix read by its leading indices."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def take_leading(x: jax.Array, index: Any) -> jax.Array:
    """`x[index]` over the leading dims for an index or a tuple of them (each in range): for scalar indices
    one dynamic slice, not a gather with negative-index fix-ups (a program holds one per expert read, and
    each costs compile time)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(jnp.ndim(i) for i in index):  # several experts at once: a gather
        return x[index]
    starts = [jnp.asarray(i, jnp.int32) for i in index] + [jnp.int32(0)] * (x.ndim - len(index))
    sizes = (1,) * len(index) + x.shape[len(index) :]
    out = jax.lax.dynamic_slice(x, starts, sizes, allow_negative_indices=False)
    return out.reshape(x.shape[len(index) :])


def flat_index(lead: tuple[int, ...], index: Any) -> jax.Array:
    """The position of matrix `index` (an index or a tuple over the leading dims `lead`; arrays of them give
    arrays of positions) in the stack flattened to [S, ...]; None: 0, the one matrix."""
    flat = jnp.int32(0)
    if index is None:
        return flat
    for i, n in zip(index if isinstance(index, tuple) else (index,), lead, strict=True):
        flat = flat * n + jnp.asarray(i, jnp.int32)
    return flat

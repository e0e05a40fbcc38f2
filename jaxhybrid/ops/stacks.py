"""Stacks of matrices (experts [E, ...], layer groups [G, E, ...]): one matrix read by its leading indices;
and pools of rows (the engine's per-slot states): rows set by their leading index."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.ops import native, registry


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


def set_rows_reference(pool: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`pool` [S, ...] with `values[b]` in slot `rows[b]` (rows [B] int32, distinct, in range)."""
    return pool.at[rows].set(values.astype(pool.dtype))


def set_rows_native(pool: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """:func:`set_rows_reference` written in place by the native CPU kernel (the result aliases `pool`)."""
    if rows.ndim != 1 or values.shape != (rows.shape[0], *pool.shape[1:]):
        raise ValueError(f"rows [B] and values [B, {pool.shape[1:]}] expected: {rows.shape}, {values.shape}")
    out = jax.ShapeDtypeStruct(pool.shape, pool.dtype)
    call = jax.ffi.ffi_call(
        native.set_rows_kernel(), out, input_output_aliases={0: 0}, vmap_method="sequential"
    )
    return call(pool, rows.astype(jnp.int32), values.astype(jnp.float32))


def set_rows_native_applies(pool: jax.Array, *_: Any, **__: Any) -> bool:
    """A float32 pool, and the kernel built."""
    return pool.dtype == jnp.float32 and native.set_rows_kernel() is not None


SET_ROWS = registry.Op(
    "set_rows", set_rows_reference, registry.cpu_kernel(set_rows_native, set_rows_native_applies)
)


def set_rows(pool: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """:func:`set_rows_reference` as `jaxhybrid.ops.registry` chooses: in a program on CPUs, for a float32
    pool, written in place by the native kernel (the result aliases `pool`: donate it), where XLA's scatter
    copies a pool that its program also reads; elsewhere the reference."""
    return SET_ROWS(pool, rows, values)

"""Causal depthwise 1-D convolution with a carried input state (the KDA short convolution).

``y[b, t, c] = sum_j weight[c, j] * xp[b, t + j, c]`` with ``xp = concat(state^T, x)`` along time,
so ``weight[:, K-1]`` multiplies the current token (PyTorch depthwise ``Conv1d`` with padding K-1,
truncated to the first T outputs). No activation is applied here. The carried state is the last
K-1 inputs, oldest first, ending at each row's last valid token, so prefill with right padding
and token-by-token decode continue from the same place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.ops import native, registry


def _prepare(x: jax.Array, weight: jax.Array, state: jax.Array | None) -> tuple[jax.Array, int]:
    """Validate shapes and return the state as [B, C, K-1] in x.dtype (zeros when absent)."""
    b, _, c = x.shape
    if weight.ndim != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be [C={c}, K]; got {weight.shape}")
    km1 = weight.shape[1] - 1
    if state is None:
        return jnp.zeros((b, c, km1), x.dtype), km1
    if state.shape != (b, c, km1):
        raise ValueError(f"state must be {(b, c, km1)}; got {state.shape}")
    return state.astype(x.dtype), km1


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    state: jax.Array | None = None,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv as a sum of K shifted slices; returns (y, new_state).

    x: [B, T, C]; weight: [C, K]; state: [B, C, K-1] previous inputs, oldest first (None =
    zeros); lengths: [B] valid tokens per row (None = all T). y is computed in float32 and
    returned in x.dtype (positions past a row's length are computed but meaningless).
    new_state: [B, C, K-1] in x.dtype, the K-1 inputs ending at each row's last valid token
    (``xp[b, n : n + K - 1]``); lengths[b] = 0 returns that row's state unchanged.
    """
    state, km1 = _prepare(x, weight, state)
    t = x.shape[1]
    xp = jnp.concatenate([jnp.swapaxes(state, 1, 2), x], axis=1)  # [B, K-1+T, C]
    xp32 = xp.astype(jnp.float32)
    w32 = weight.astype(jnp.float32)
    y = sum(w32[:, j] * xp32[:, j : j + t, :] for j in range(km1 + 1))
    if lengths is None:
        tail = xp[:, t:, :]
    else:
        n = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, t)
        idx = n[:, None] + jnp.arange(km1)[None, :]  # [B, K-1], always within [0, T+K-2]
        tail = jnp.take_along_axis(xp, idx[:, :, None], axis=1)
    return y.astype(x.dtype), jnp.swapaxes(tail, 1, 2)


def causal_conv1d_into_pool_reference(
    x: jax.Array,
    weight: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d` from the states `pool[rows]` (pool [S, C, K-1], rows [B] int32, distinct):
    (y, the pool with each row's new state in its slot)."""
    y, new = causal_conv1d(x, weight, pool[rows], lengths)
    return y, pool.at[rows].set(new.astype(pool.dtype))


def causal_conv1d_into_pool_native(
    x: jax.Array,
    weight: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d_into_pool_reference` for one token per row through the native CPU kernel: each
    row's window read in its slot and moved on there (the result aliases `pool`)."""
    f32 = jnp.float32
    b, _, c = x.shape
    if weight.ndim != 2 or pool.shape[1:] != (c, weight.shape[1] - 1) or rows.shape != (b,):
        want = f"weight [{c}, K], pool [S, {c}, K-1], rows [{b}]"
        raise ValueError(f"{want} expected: {weight.shape}, {pool.shape}, {rows.shape}")
    valid = jnp.ones((b,), jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    out = (jax.ShapeDtypeStruct((b, c), f32), jax.ShapeDtypeStruct(pool.shape, f32))
    target = native.kda_pool_kernels()[1]
    call = jax.ffi.ffi_call(target, out, input_output_aliases={2: 1}, vmap_method="sequential")
    y, new = call(x[:, 0], weight.astype(f32), pool, rows.astype(jnp.int32), valid)
    return y[:, None], new


def causal_conv1d_into_pool_native_applies(
    x: jax.Array, weight: jax.Array, pool: jax.Array, *_: Any, **__: Any
) -> bool:
    """One token per row, float32 tokens and pool, and the kernel built."""
    f32 = jnp.float32
    return x.shape[1] == 1 and x.dtype == pool.dtype == f32 and native.kda_pool_kernels() is not None


CAUSAL_CONV1D_INTO_POOL = registry.Op(
    "causal_conv1d_into_pool",
    causal_conv1d_into_pool_reference,
    registry.cpu_kernel(causal_conv1d_into_pool_native, causal_conv1d_into_pool_native_applies),
)


def causal_conv1d_into_pool(
    x: jax.Array,
    weight: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d_into_pool_reference` as `jaxhybrid.ops.registry` chooses: on the CPU for one
    token per row the native kernel, which reads each row's window in its slot and moves it on there (the
    result aliases `pool`: donate it, else XLA copies it first). In a program that reads the pool and
    scatters into it, XLA:CPU fuses the read into the scatter and then copies the whole pool, twice.
    Elsewhere, or where the kernel does not apply, the reference."""
    return CAUSAL_CONV1D_INTO_POOL(x, weight, pool, rows, lengths)


def causal_conv1d_windows(
    x: jax.Array,
    weight: jax.Array,
    state: jax.Array | None = None,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_conv1d` with the carried state after every token: (y, windows [B, T, C, K-1]).
    windows[:, t] is the new_state `causal_conv1d` returns for lengths min(t + 1, lengths) (past a row's
    length it stays at the state after its last valid token)."""
    y, _ = causal_conv1d(x, weight, state, lengths)
    state, km1 = _prepare(x, weight, state)
    b, t = x.shape[:2]
    xp = jnp.concatenate([jnp.swapaxes(state, 1, 2), x], axis=1)  # [B, K-1+T, C]
    n = jnp.arange(1, t + 1)[None, :]  # valid tokens after each position
    if lengths is not None:
        n = jnp.minimum(n, jnp.clip(jnp.asarray(lengths, jnp.int32), 0, t)[:, None])
    n = jnp.broadcast_to(n, (b, t))
    idx = n[:, :, None] + jnp.arange(km1)[None, None, :]  # [B, T, K-1]
    windows = jnp.take_along_axis(xp[:, None], idx[..., None], axis=2)  # [B, T, K-1, C]
    return y, jnp.swapaxes(windows, 2, 3)


def causal_conv1d_reference(
    x: jax.Array,
    weight: jax.Array,
    state: jax.Array | None = None,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as :func:`causal_conv1d`, written as a per-token loop (``lax.scan``).

    Keeps a rolling window of the last K-1 inputs, emits one output per token, and snapshots the
    window after each row's last valid token. Slow; used to check the fast form.
    """
    state, km1 = _prepare(x, weight, state)
    b, t, _ = x.shape
    n = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    w32 = weight.astype(jnp.float32)

    def step(
        carry: tuple[jax.Array, jax.Array], inp: tuple[jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        window, saved = carry  # both [B, C, K-1]
        x_t, pos = inp  # [B, C], scalar
        full = jnp.concatenate([window, x_t[:, :, None]], axis=2)  # [B, C, K]
        y_t = jnp.sum(full.astype(jnp.float32) * w32[None], axis=2)
        window = full[:, :, 1:]
        saved = jnp.where((pos < n)[:, None, None], window, saved)
        return (window, saved), y_t

    (_, saved), y = jax.lax.scan(step, (state, state), (jnp.swapaxes(x, 0, 1), jnp.arange(t)))
    return jnp.swapaxes(y, 0, 1).astype(x.dtype), saved

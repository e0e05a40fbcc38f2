"""Kimi Delta Attention (KDA): gated delta rule with per-key-channel decay.

Per batch row and head the fp32 state ``S`` in ``R^{dk x dv}`` evolves as::

    S <- diag(exp(g_t)) S                        # g_t <= 0, one log-decay per key channel
    S <- S + beta_t * k_t (v_t - k_t^T S)^T       # delta-rule write, beta_t scalar
    o_t = S^T q_t

``q`` and ``k`` arrive already L2-normalised (and ``q`` already scaled); these ops never normalise.
Two forms share one signature: :func:`kda_recurrent` (token-by-token ``lax.scan``; the decode
path and the reference) and :func:`kda_chunked` (chunkwise-parallel prefill). Padded positions
must carry ``g = 0`` and ``beta = 0``: they then leave the state unchanged (nothing divides by
``beta``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST  # keep matmuls in true fp32 on accelerators (no TF32/bf16 passes)


def _check_shapes(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, initial_state: jax.Array | None
) -> None:
    """Fail early with a readable message when the inputs do not line up."""
    b, t, h, dk = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a shape: {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (b, t, h):
        raise ValueError(f"v must be [B, T, H, dv] matching q {q.shape}; got {v.shape}")
    if beta.shape != (b, t, h):
        raise ValueError(f"beta must be [B, T, H] = {(b, t, h)}; got {beta.shape}")
    if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(f"initial_state must be {(b, h, dk, v.shape[-1])}; got {initial_state.shape}")


def _init_state(initial_state: jax.Array | None, b: int, h: int, dk: int, dv: int) -> jax.Array:
    """Zeros when no state is given, else the given state in fp32."""
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), jnp.float32)
    return initial_state.astype(jnp.float32)


def kda_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """KDA one token at a time (``lax.scan`` over T): the decode path and the reference.

    Shapes: q, k, g [B, T, H, dk]; v [B, T, H, dv]; beta [B, T, H]; initial_state
    [B, H, dk, dv] or None (zeros). Returns (o [B, T, H, dv] in v.dtype, final state
    [B, H, dk, dv] float32). All arithmetic is float32.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    # Time-major for the scan: [T, B, H, ...].
    xs = (
        jnp.moveaxis(q.astype(f32), 1, 0),
        jnp.moveaxis(k.astype(f32), 1, 0),
        jnp.moveaxis(v.astype(f32), 1, 0),
        jnp.moveaxis(g.astype(f32), 1, 0),
        jnp.moveaxis(beta.astype(f32), 1, 0),
    )

    def step(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., :, None]
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=_HI)
        s = s + (b_t[..., None, None] * k_t[..., :, None]) * (v_t - pred)[..., None, :]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=_HI)
        return s, o_t

    s_final, o = jax.lax.scan(step, _init_state(initial_state, b, h, dk, dv), xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), s_final


def _segment_log_decay(g: jax.Array) -> jax.Array:
    """Pairwise in-chunk log-decay ``seg[..., i, j, c] = sum_{j < t <= i} g[..., t, c]`` (0 for i <= j).

    Summed directly over each segment rather than as ``cum_i - cum_j``: with g as low as about
    -20 per step the cumulative sums reach -1000s and their difference would lose ~1e-4 absolute
    precision, which is a ~1e-4 relative error on exp(seg) for nearby pairs. The entries are
    all <= 0, so exp never overflows. g: [..., C, dk] -> [..., C, C, dk].
    """
    c = g.shape[-2]
    t_idx = jnp.arange(c)
    after_j = t_idx[:, None] > t_idx[None, :]  # [t, j]: t > j
    masked = jnp.where(after_j[:, :, None], g[..., :, None, :], 0.0)  # [..., t, j, dk]
    return jnp.cumsum(masked, axis=-3)  # running sum over t gives [..., i, j, dk]


def _chunk_step(s0: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Advance the state over one chunk and return its outputs.

    s0: [B, H, dk, dv]; chunk arrays are [B, H, C, d] (beta [B, H, C]). Writing the state after
    token i as ``S_i = diag(exp(cum_i)) S0 + sum_{j<=i} diag(exp(seg_ij)) k_j u_j^T``, the write
    vectors u solve the unit-lower-triangular system ``(I + A) U = beta * (V - (K*exp(cum)) S0)``
    with ``A_ij = beta_i k_i^T diag(exp(seg_ij)) k_j`` for j < i.
    """
    q, k, v, g, beta = chunk
    c = q.shape[-2]
    seg = _segment_log_decay(g)  # [B, H, C, C, dk]
    cum = jnp.cumsum(g, axis=-2)  # decay from the chunk start, [B, H, C, dk]
    incl = jnp.tril(jnp.ones((c, c), dtype=bool))  # j <= i
    strict = jnp.tril(jnp.ones((c, c), dtype=bool), k=-1)  # j < i
    dec = jnp.where(incl[:, :, None], jnp.exp(seg), 0.0)

    kk = jnp.einsum("bhic,bhijc,bhjc->bhij", k, dec, k, precision=_HI)
    qk = jnp.einsum("bhic,bhijc,bhjc->bhij", q, dec, k, precision=_HI)  # causal incl. diagonal
    a = jnp.where(strict, beta[..., :, None] * kk, 0.0)

    e_cum = jnp.exp(cum)
    rhs = beta[..., None] * (v - jnp.einsum("bhic,bhcv->bhiv", k * e_cum, s0, precision=_HI))
    eye = jnp.eye(c, dtype=a.dtype)
    u = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)

    o = jnp.einsum("bhic,bhcv->bhiv", q * e_cum, s0, precision=_HI) + jnp.einsum(
        "bhij,bhjv->bhiv", qk, u, precision=_HI
    )
    k_to_end = k * jnp.exp(seg[..., -1, :, :])  # decay from token j to the chunk end
    s1 = jnp.exp(cum[..., -1, :])[..., :, None] * s0 + jnp.einsum(
        "bhjc,bhjv->bhcv", k_to_end, u, precision=_HI
    )
    return s1, o


def kda_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """KDA in chunkwise-parallel form (prefill); same contract as :func:`kda_recurrent`.

    T is zero-padded (q, k, v, beta and g = 0, so padding leaves the state unchanged) up to a
    multiple of the chunk length ``min(chunk_size, T)``. Inside a chunk all interactions are
    computed at once from pairwise segment log-decays and the delta-rule dependency is resolved
    with a unit-lower-triangular solve (the WY/UT transform); ``lax.scan`` carries the state
    across chunks. The per-chunk step is rematerialised under autodiff so the backward pass does
    not keep one [C, C, dk] decay tensor per chunk alive.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    s0 = _init_state(initial_state, b, h, dk, dv)
    if t == 0:
        return jnp.zeros((b, 0, h, dv), v.dtype), s0
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    f32 = jnp.float32

    def to_chunks(x: jax.Array) -> jax.Array:
        """[B, T, H, ...] -> [N, B, H, C, ...], zero-padded along T."""
        x = x.astype(f32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, c) + x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    xs = tuple(to_chunks(x) for x in (q, k, v, g, beta))
    s_final, o = jax.lax.scan(jax.checkpoint(_chunk_step), s0, xs)  # o: [N, B, H, C, dv]
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, n * c, h, dv)[:, :t]
    return o.astype(v.dtype), s_final

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.ops import native, placement, registry

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


def _token_scan(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
    keep_states: bool,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence token by token (``lax.scan`` over T, float32): (o [B, T, H, dv] in v.dtype, the final
    state [B, H, dk, dv], or with `keep_states` the state after every token [B, T, H, dk, dv])."""
    _check_shapes(q, k, v, g, beta, initial_state)
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))  # time-major

    def step(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, Any]:
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., :, None]
        pred = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=_HI)
        s = s + (b_t[..., None, None] * k_t[..., :, None]) * (v_t - pred)[..., None, :]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=_HI)
        return s, ((o_t, s) if keep_states else o_t)

    s_final, out = jax.lax.scan(step, _init_state(initial_state, b, h, dk, dv), xs)
    if keep_states:
        o, states = out
        return jnp.moveaxis(o, 0, 1).astype(v.dtype), jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), s_final


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
    return _token_scan(q, k, v, g, beta, initial_state, keep_states=False)


def _states_and_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
    rows: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """What the native kernels take for the rows' starting states, checked: (states [S, H, dk, dv] float32,
    rows [B] int32), row b starting from states[rows[b]] (the given states, or zeros, row by row without
    `rows`; the pool `initial_state` with them)."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    if rows is None:
        _check_shapes(q, k, v, g, beta, initial_state)
        return _init_state(initial_state, b, h, dk, dv), jnp.arange(b, dtype=jnp.int32)
    _check_shapes(q, k, v, g, beta, None)
    _require_pool(initial_state, rows)
    if initial_state.shape[1:] != (h, dk, dv) or rows.shape != (b,):
        raise ValueError(
            f"a pool [S, {h}, {dk}, {dv}] and rows [{b}] expected: {initial_state.shape}, {rows.shape}"
        )
    return initial_state.astype(jnp.float32), rows.astype(jnp.int32)


def _require_pool(initial_state: jax.Array | None, rows: jax.Array | None) -> None:
    if rows is not None and initial_state is None:
        raise ValueError("rows index a pool of states: give the pool as initial_state")


def _reference_start(initial_state: jax.Array | None, rows: jax.Array | None) -> jax.Array | None:
    """The XLA references' `initial_state`: the given states, or with `rows` the pool's rows."""
    _require_pool(initial_state, rows)
    return initial_state if rows is None else initial_state[rows]


def kda_decode_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_recurrent`, with `rows` ([B] int32) into a pool of states `initial_state` [S, H, dk, dv]:
    row b starts from `initial_state[rows[b]]` (a copy of the rows taken out of the pool first)."""
    return kda_recurrent(q, k, v, g, beta, _reference_start(initial_state, rows))


def kda_decode_native(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_decode_reference` for one token per row through the native CPU kernel, which reads each
    row's state in place (in its pool slot with `rows`) once and writes the new one once."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    state, at = _states_and_rows(q, k, v, g, beta, initial_state, rows)
    f32 = lambda x: x[:, 0].astype(jnp.float32)  # noqa: E731
    out = (
        jax.ShapeDtypeStruct((b, h, dv), jnp.float32),
        jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
    )
    call = jax.ffi.ffi_call(native.kda_decode_kernel(), out, vmap_method="sequential")
    o, new = call(f32(q), f32(k), f32(g), f32(v), f32(beta), state, at.astype(jnp.int32))
    return o[:, None].astype(v.dtype), new


def kda_decode_native_applies(q: jax.Array, *_: Any, **__: Any) -> bool:
    """One token per row, and the kernel built."""
    return q.shape[1] == 1 and native.kda_decode_kernel() is not None


KDA_DECODE = registry.Op(
    "kda_decode", kda_decode_reference, registry.cpu_kernel(kda_decode_native, kda_decode_native_applies)
)


def kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_recurrent` for a decode step, as `jaxhybrid.ops.registry` chooses: on the CPU for one
    token per row the native kernel (`jaxhybrid.ops.native`, one read and one write of each state where
    XLA:CPU makes a dozen passes); elsewhere, or for longer T, :func:`kda_decode_reference`. Same signature
    and results, and `rows` ([B] int32): `initial_state` is then a pool of states [S, H, dk, dv] and row b
    starts from `initial_state[rows[b]]`, which the kernel reads in place (XLA copies a slot out of a pool
    first)."""
    return KDA_DECODE(q, k, v, g, beta, initial_state, rows)


def kda_decode_into_pool_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token per row (T == 1) from the states `pool[rows]` ([S, H, dk, dv] float32, rows [B] int32,
    distinct): (o [B, 1, H, dv] in v.dtype, the pool with each row's new state in its slot)."""
    o, new = kda_recurrent(q, k, v, g, beta, pool[rows])
    return o, pool.at[rows].set(new.astype(pool.dtype))


def kda_decode_into_pool_native(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_decode_into_pool_reference` through the native CPU kernel: each row's state read in its
    slot and the new one written over it (the result aliases `pool`)."""
    b, _, h, _ = q.shape
    dv = v.shape[-1]
    states, at = _states_and_rows(q, k, v, g, beta, pool, rows)
    f32 = lambda x: x[:, 0].astype(jnp.float32)  # noqa: E731
    out = (jax.ShapeDtypeStruct((b, h, dv), jnp.float32), jax.ShapeDtypeStruct(pool.shape, jnp.float32))
    target = native.kda_pool_kernels()[0]
    call = jax.ffi.ffi_call(target, out, input_output_aliases={5: 1}, vmap_method="sequential")
    o, new = call(f32(q), f32(k), f32(g), f32(v), f32(beta), states, at)
    return o[:, None].astype(v.dtype), new


def kda_decode_into_pool_native_applies(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, pool: jax.Array, rows: jax.Array
) -> bool:
    """One token per row, a float32 pool (what the kernel writes), and the kernel built."""
    return q.shape[1] == 1 and pool.dtype == jnp.float32 and native.kda_pool_kernels() is not None


KDA_DECODE_INTO_POOL = registry.Op(
    "kda_decode_into_pool",
    kda_decode_into_pool_reference,
    registry.cpu_kernel(kda_decode_into_pool_native, kda_decode_into_pool_native_applies),
)


def kda_decode_into_pool(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_decode_into_pool_reference` as `jaxhybrid.ops.registry` chooses: on the CPU the native
    kernel, which reads each row's state in its slot and writes the new one over it (the result aliases
    `pool`: donate it, else XLA copies it first); no [B, H, dk, dv] states are made, no scatter runs.
    Elsewhere, or where the kernel does not apply, the reference."""
    return KDA_DECODE_INTO_POOL(q, k, v, g, beta, pool, rows)


def steps_into_pools(platform: str) -> bool:
    """Whether :func:`kda_decode_into_pool` and `conv.causal_conv1d_into_pool` update their pools in place in
    a program on `platform`'s devices (CPUs, with the native kernels, where the kernels mode allows them);
    elsewhere they are XLA's scatters, which copy a pool that the same program reads."""
    allowed = registry.allows(registry.Kind.NATIVE)
    return platform == placement.CPU and allowed and native.kda_pool_kernels() is not None


def kda_recurrent_states(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_recurrent` that returns the state after every token, [B, T, H, dk, dv] float32, in place
    of the final one (what verifying drafted tokens needs: the state at the last accepted position). Same
    arithmetic; costs T states of memory."""
    return _token_scan(q, k, v, g, beta, initial_state, keep_states=True)


def kda_decode_states_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_recurrent_states`, with `rows` as :func:`kda_decode_reference`'s."""
    return kda_recurrent_states(q, k, v, g, beta, _reference_start(initial_state, rows))


def kda_decode_states_native(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_decode_states_reference` through the native CPU kernel (each state written once)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    state, at = _states_and_rows(q, k, v, g, beta, initial_state, rows)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out = (
        jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
        jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32),
    )
    call = jax.ffi.ffi_call(native.kda_states_kernel(), out, vmap_method="sequential")
    o, states = call(f32(q), f32(k), f32(g), f32(v), f32(beta), state, at.astype(jnp.int32))
    return o.astype(v.dtype), states


def kda_decode_states_native_applies(*_: Any, **__: Any) -> bool:
    """The kernel built (it takes any number of tokens)."""
    return native.kda_states_kernel() is not None


KDA_DECODE_STATES = registry.Op(
    "kda_decode_states",
    kda_decode_states_reference,
    registry.cpu_kernel(kda_decode_states_native, kda_decode_states_native_applies),
)


def kda_decode_states(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`kda_recurrent_states` as `jaxhybrid.ops.registry` chooses: on the CPU the native kernel (a
    verify step's few tokens per row: each state written once, where XLA:CPU runs a dozen ops a token);
    elsewhere :func:`kda_decode_states_reference`. Same results, and `rows` as :func:`kda_decode`'s (row b
    starts from the pool's `initial_state[rows[b]]`)."""
    return KDA_DECODE_STATES(q, k, v, g, beta, initial_state, rows)


def _mask_sum(mask: np.ndarray, x: jax.Array) -> jax.Array:
    """``out[..., i, :] = sum_j mask[i, j] x[..., j, :]`` for a constant 0/1 ``mask``: one matmul.

    Used for every running sum of log-decays. All entries of x are <= 0, so these direct sums
    have relative error ~eps however long they run; no sum here is ever formed as the difference
    of two longer ones (with g down to about -20 per step, cumulative sums reach -1000s, and
    ``cum_i - cum_j`` would lose ~1e-4 absolute precision on a small exponent).
    """
    return jnp.einsum("ij,...jd->...id", jnp.asarray(mask, x.dtype), x, precision=_HI)


def _chunk_matrices(q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two [..., C, C] matrices of a chunk, by recursive doubling over blocks; C a power of two.

    With b the in-chunk cumulative log-decay (``b_i - b_j = sum_{j < t <= i} g_t``) returns
    ``P_ij = q_i^T diag(exp(b_i - b_j)) k_j`` for j <= i (0 above) and ``T = (I + A)^{-1}`` with
    ``A_ij = beta_i k_i^T diag(exp(b_i - b_j)) k_j`` for j < i (unit lower triangular).

    Start from 1 x 1 diagonal blocks (``P_ii = q_i . k_i``, ``T_ii = 1``) and repeatedly join
    neighbouring blocks of length m. The joined block's new lower-left part has i in the right
    half and j in the left one, and its decay factors through their boundary as
    ``exp(sum over [start of right half, i]) * exp(sum over (j, end of left half])``: both
    exponents are direct sums of log-decays <= 0, so nothing overflows and underflow is the
    right limit, and the part is a plain matmul of decay-scaled rows of q (for P) and k (for A)
    with decay-scaled rows of k. The inverse joins the same way:
    ``[[T0, 0], [A21, T1]]``-blocks give ``[[T0, 0], [-T1 A21 T0, T1]]``. log2(C) rounds of
    batched matmuls in all: no [C, C, dk] decay tensor, and no triangular-solve kernel (the
    XLA:CPU LAPACK ``trsm`` call was seen to deadlock a 2-thread intra-op pool when the forward
    and backward solves ran at once).
    """
    *lead, c, dk = q.shape
    lead = tuple(lead)
    p_blk = jnp.sum(q * k, axis=-1)[..., :, None, None]  # [..., C, 1, 1]: blocks of length m = 1
    t_blk = jnp.ones_like(p_blk)
    m = 1
    while m < c:
        nb = c // (2 * m)
        gh, kh, qh = (x.reshape(lead + (nb, 2, m, dk)) for x in (g, k, q))
        e_row = jnp.exp(_mask_sum(np.tri(m, dtype=bool), gh[..., 1, :, :]))  # [start of right half, i]
        e_col = jnp.exp(_mask_sum(~np.tri(m, dtype=bool), gh[..., 0, :, :]))  # (j, end of left half]
        rows = jnp.stack([qh[..., 1, :, :] * e_row, kh[..., 1, :, :] * e_row], axis=-3)  # [..., nb, 2, m, dk]
        cross = jnp.einsum("...pxid,...pjd->...pxij", rows, kh[..., 0, :, :] * e_col, precision=_HI)
        a21 = beta.reshape(lead + (nb, 2, m))[..., 1, :, None] * cross[..., 1, :, :]
        p0, p1 = jnp.unstack(p_blk.reshape(lead + (nb, 2, m, m)), axis=-3)
        t0, t1 = jnp.unstack(t_blk.reshape(lead + (nb, 2, m, m)), axis=-3)
        t21 = -jnp.matmul(t1, jnp.matmul(a21, t0, precision=_HI), precision=_HI)
        p_blk = _join(p0, cross[..., 0, :, :], p1)
        t_blk = _join(t0, t21, t1)
        m *= 2
    return p_blk[..., 0, :, :], t_blk[..., 0, :, :]


def _join(top_left: jax.Array, bottom_left: jax.Array, bottom_right: jax.Array) -> jax.Array:
    """``[[top_left, 0], [bottom_left, bottom_right]]`` from three [..., m, m] blocks."""
    top = jnp.concatenate([top_left, jnp.zeros_like(top_left)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([bottom_left, bottom_right], axis=-1)], axis=-2)


def _chunk_step(s0: jax.Array, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Advance the state over one chunk and return its outputs.

    s0: [B, H, dk, dv]; chunk arrays are [B, H, C, d] (beta [B, H, C]), C a power of two.
    Writing the state after token i as ``S_i = diag(exp(b_i)) S0 + sum_{j<=i} diag(exp(b_i - b_j))
    k_j u_j^T`` (b the in-chunk cumulative log-decay), the write vectors u solve the
    unit-lower-triangular system ``(I + A) U = beta * (V - (K*exp(b)) S0)``; with P and
    T = (I + A)^{-1} from :func:`_chunk_matrices` everything else is plain matmuls.
    """
    q, k, v, g, beta = chunk
    p, t_inv = _chunk_matrices(q, k, g, beta)
    tri = np.tri(q.shape[-2], dtype=bool)
    e_cum = jnp.exp(_mask_sum(tri, g))  # decay from the chunk start through token i
    e_end = jnp.exp(_mask_sum(~tri, g))  # decay after token j to the chunk end
    e_all = jnp.exp(jnp.sum(g, axis=-2))  # the whole chunk
    rhs = beta[..., None] * (v - jnp.einsum("bhic,bhcv->bhiv", k * e_cum, s0, precision=_HI))
    u = jnp.einsum("bhij,bhjv->bhiv", t_inv, rhs, precision=_HI)
    o = jnp.einsum("bhic,bhcv->bhiv", q * e_cum, s0, precision=_HI) + jnp.einsum(
        "bhij,bhjv->bhiv", p, u, precision=_HI
    )
    s1 = e_all[..., :, None] * s0 + jnp.einsum("bhjc,bhjv->bhcv", k * e_end, u, precision=_HI)
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

    The chunk length C is the largest power of two <= ``chunk_size``, or the smallest one >= T
    when T is shorter; T is zero-padded (q, k, v, beta and g = 0, so padding leaves the state
    unchanged) up to a multiple of C. Inside a chunk every interaction is a matmul of
    decay-scaled queries and keys, built and inverted by recursive doubling (the WY/UT
    transform, :func:`_chunk_matrices`); ``lax.scan`` carries the state across chunks. The
    per-chunk step is rematerialised under autodiff so the backward pass keeps only each chunk's
    inputs alive.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    s0 = _init_state(initial_state, b, h, dk, dv)
    if t == 0:
        return jnp.zeros((b, 0, h, dv), v.dtype), s0
    c = min(1 << (chunk_size.bit_length() - 1), 1 << (t - 1).bit_length())  # a power of two
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

"""Pallas TPU kernels for KDA, each equal (to fp32 rounding) to its reference in :mod:`jaxhybrid.ops.kda`.

* :func:`kda_chunked_pallas` is :func:`~jaxhybrid.ops.kda.kda_chunked` (the chunkwise prefill): one grid
  step per (row, head, chunk), the chunk axis sequential, the fp32 state carried from chunk to chunk in VMEM
  scratch; inside a chunk the WY form of :func:`~jaxhybrid.ops.kda._chunk_step`.
* :func:`kda_decode_into_pool_pallas` is :func:`~jaxhybrid.ops.kda.kda_decode_into_pool_reference` (one
  token per row): row b's state is the pool's slot ``rows[b]``, found through scalar prefetch by the
  BlockSpecs that read and write it; the pool is aliased to the result, so under a donating ``jit`` each
  step reads and writes only the rows' slots (no copy of the pool, no gather, no scatter).
* :func:`kda_decode_states_pallas` is :func:`~jaxhybrid.ops.kda.kda_recurrent_states` from the pool's rows
  (the verify step's few tokens): the state after every token, written straight into its output block.

The kernels do the references' arithmetic: every product an fp32 matmul at HIGHEST precision or an fp32
elementwise op, every running sum of log-decays a direct masked sum (as in the reference, never the
difference of two longer sums), the same block inverse; they differ from the references only in the order
of fp32 additions.

TPU layout. A block's last two dims must be multiples of (8, 128) or the array's own; head dims are 128 in
the models but 16 in the tiny configs, so every block's last two dims are whole array dims: the prefill's
inputs are laid out heads-major ([B, H, T, d], transposed outside the kernel, each chunk a (C, d) block,
beta [B, H, N, C] whole per row and head); the decode kernels' per-token vectors get a unit axis
([B, T, H, 1, d], a reshape) and a block covers a few heads. Vectors that scale a state's rows (the decay,
beta * k) arrive as rows and are turned into columns exactly (:func:`_column`). The pool is read and written
in place when its device layout is row-major, as XLA lays out 128-wide states on TPU; for 16-wide ones its
default TPU layout puts the slot axis minor, and XLA converts the pool around the call.

Call the kernels on TPU inside ``jax.shard_map`` (Mosaic kernels cannot be partitioned automatically); on
any backend ``interpret=True`` runs them as plain JAX (what the tests compare with the references).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxhybrid.ops.kda import _check_shapes, _init_state

__all__ = [
    "kda_chunked_cost",
    "kda_chunked_pallas",
    "kda_decode_into_pool_cost",
    "kda_decode_into_pool_pallas",
    "kda_decode_states_cost",
    "kda_decode_states_pallas",
]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
_STATE_BLOCK_BYTES = 512 * 1024  # fp32 states of one decode block (a few heads; in and out double-buffered)
_MIN_CHUNK = 16  # several chunks: each a whole (16, 128) tile of 16-bit rows


# ----------------------------------------------------------------------------- in-kernel helpers


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """An fp32 matmul at HIGHEST precision contracting a's dim contract[0] with b's dim contract[1]:
    (1, 0) is ``a @ b``, (1, 1) ``a @ b.T``, (0, 0) ``a.T @ b``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=_F32)


def _iotas(n: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of an (n, n) matrix."""
    return jax.lax.broadcasted_iota(jnp.int32, (n, n), 0), jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)


def _column(row: jax.Array) -> jax.Array:
    """A (1, n) row as an (n, 1) column, exactly: spread over the diagonal and summed along lanes (every
    other term is zero). Mosaic transposes only whole tiles; this works for any n."""
    i, j = _iotas(row.shape[-1])
    return jnp.sum(jnp.where(i == j, row, 0.0), axis=1, keepdims=True)


def _mask_sum(mask: jax.Array, x: jax.Array) -> jax.Array:
    """``out[i] = sum_j mask[i, j] x[j]`` for a boolean (C, C) mask: a direct sum as one matmul (the
    reference's `_mask_sum`: all of x <= 0, so the sum's relative error is ~eps however long it runs)."""
    return _dot(jnp.where(mask, 1.0, 0.0).astype(_F32), x)


def _pair_matrices(q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A chunk's ``P`` (j <= i: ``q_i^T diag(exp(b_i - b_j)) k_j``) and ``T = (I + A)^{-1}`` (``A_ij = beta_i
    k_i^T diag(exp(b_i - b_j)) k_j``, j < i), by the reference's recursive doubling over blocks, written as
    full (C, C) products with masks instead of slices (Mosaic slices only whole tiles).

    At level m every pair (i, j) with i in the right half and j in the left half of one 2m-block gets its
    decay factored through that boundary: ``exp(sum from the start of i's m-block to i) * exp(sum after j to
    the end of j's m-block)``, both direct sums of log-decays <= 0 (nothing overflows). T starts as I and
    each level turns the inverse of the m-blocks into that of the 2m-blocks: ``T <- T - T X T`` with X the
    level's part of A, which is ``[[T0, 0], [-T1 A21 T0, T1]]`` block by block.

    The price of whole-width masks: each level is six (C, C)-sized products, in all three times the flops
    of the rest of the chunk at C = 64 and dk = dv = 128 (:func:`kda_chunked_cost`), all on the MXU.
    """
    c = q.shape[0]
    i, j = _iotas(c)
    p = jnp.where(i == j, jnp.sum(q * k, axis=1, keepdims=True), 0.0)
    t_inv = jnp.where(i == j, 1.0, 0.0).astype(_F32)
    level = 0
    while (1 << level) < c:
        bi, bj = i >> level, j >> level  # the m-blocks of row i and column j
        same = bi == bj
        e_row = jnp.exp(_mask_sum(same & (j <= i), g))  # row i: from the start of its block through i
        e_col = jnp.exp(_mask_sum(same & (j > i), g))  # row j: after j to the end of its block
        cross = (bi == bj + 1) & ((bi & 1) == 1)  # i in a right half, j in the left half beside it
        k_col = k * e_col
        p = p + jnp.where(cross, _dot(q * e_row, k_col, (1, 1)), 0.0)
        a21 = jnp.where(cross, beta * _dot(k * e_row, k_col, (1, 1)), 0.0)
        t_inv = t_inv - _dot(t_inv, _dot(a21, t_inv))
        level += 1
    return p, t_inv


def _chunk_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, s_ref, state) -> None:
    """One (row, head, chunk) step: the reference's `_chunk_step` on the state in scratch."""
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _() -> None:
        state[...] = s0_ref[...]

    q, k, v, g = (r[...].astype(_F32) for r in (q_ref, k_ref, v_ref, g_ref))
    beta = _column(beta_ref[pl.ds(n, 1), :].astype(_F32))  # (C, 1)
    s0 = state[...]
    p, t_inv = _pair_matrices(q, k, g, beta)
    i, j = _iotas(q.shape[0])
    e_cum = jnp.exp(_mask_sum(j <= i, g))  # decay from the chunk start through token i
    e_end = jnp.exp(_mask_sum(j > i, g))  # decay after token j to the chunk end
    e_all = jnp.exp(_column(jnp.sum(g, axis=0, keepdims=True)))  # the whole chunk, per key channel (dk, 1)
    u = _dot(t_inv, beta * (v - _dot(k * e_cum, s0)))
    o_ref[...] = (_dot(q * e_cum, s0) + _dot(p, u)).astype(o_ref.dtype)
    s1 = e_all * s0 + _dot(k * e_end, u, (0, 0))
    state[...] = s1

    @pl.when(n == pl.num_programs(2) - 1)
    def _() -> None:
        s_ref[...] = s1


def _token(s, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """One token of one head, as the reference's scan step: s (dk, dv) fp32; q, k, g (1, dk); v (1, dv);
    beta (1, 1). Returns (the new state, o (1, dv))."""
    s = s * jnp.exp(_column(g))
    pred = _dot(k, s)
    s = s + _column(beta * k) * (v - pred)
    return s, _dot(q, s)


def _pool_kernel(rows_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, new_ref) -> None:
    """One (row, head block) step: each head's state read from and written over the row's pool slot."""
    del rows_ref  # used by the BlockSpecs
    for h in range(q_ref.shape[0]):
        x = (r[h].astype(_F32) for r in (q_ref, k_ref, v_ref, g_ref, beta_ref))
        s, o = _token(pool_ref[h].astype(_F32), *x)
        new_ref[h] = s.astype(new_ref.dtype)
        o_ref[h] = o.astype(o_ref.dtype)


def _states_kernel(
    rows_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, states_ref, state
) -> None:
    """One (row, head block, token) step, tokens in order: the heads' states carried in scratch (from the
    row's pool slot at the first token), each written out."""
    del rows_ref

    @pl.when(pl.program_id(2) == 0)
    def _() -> None:
        state[...] = pool_ref[...].astype(_F32)

    for h in range(q_ref.shape[0]):
        x = (r[h].astype(_F32) for r in (q_ref, k_ref, v_ref, g_ref, beta_ref))
        s, o = _token(state[h], *x)
        state[h] = s
        states_ref[h] = s
        o_ref[h] = o.astype(o_ref.dtype)


# ----------------------------------------------------------------------------- shapes and costs


def _chunk_length(t: int, chunk: int) -> int:
    """The kernel's chunk C: as :func:`~jaxhybrid.ops.kda.kda_chunked`'s (the largest power of two <= chunk,
    or the smallest one >= T when T is shorter), but at least 16 when T spans several chunks (a chunk is a
    block's second-to-last dim: whole sublane tiles, or the whole padded T)."""
    return min(max(1 << (chunk.bit_length() - 1), _MIN_CHUNK), 1 << (t - 1).bit_length())


def _nbytes(x: Any, n: int) -> int:
    """Bytes of n elements of x's dtype."""
    return n * jnp.dtype(x.dtype).itemsize


def kda_chunked_cost(q: Any, k: Any, v: Any, g: Any, beta: Any, chunk: int = 64) -> pl.CostEstimate:
    """What :func:`kda_chunked_pallas` reads, writes and computes for these shapes (arrays or
    ShapeDtypeStructs): every (C, d) block of q, k, g, v and o once over the padded T, beta (fp32) whole once
    per row and head, the fp32 state in and out once per row and head; as flops those of the kernel's matmuls
    (log2 C doubling levels, then the state's products) and of its elementwise ops on the state; one
    transcendental per element it exponentiates."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if t == 0:
        return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=0)
    c = _chunk_length(t, chunk)
    tp = -(-t // c) * c
    tokens = b * h * tp
    state = b * h * dk * dv * 4
    read = _nbytes(q, tokens * dk) + _nbytes(k, tokens * dk) + _nbytes(g, tokens * dk)
    read += _nbytes(v, tokens * dv) + tokens * 4 + state  # beta in fp32
    written = _nbytes(v, tokens * dv) + state
    levels = (c - 1).bit_length()
    per_level = 4 * (2 * c * c * dk) + 2 * (2 * c * c * c)  # 2 decay sums, P's and A's crossings; T's update
    per_chunk = levels * per_level + 2 * (2 * c * c * dk) + 3 * (2 * c * dk * dv) + 2 * (2 * c * c * dv)
    per_chunk += 2 * dk * dv  # the state's decay and sum
    exps = levels * 2 * c * dk + 2 * c * dk + dk
    n = tokens // c
    return pl.CostEstimate(flops=n * per_chunk, transcendentals=n * exps, bytes_accessed=read + written)


def _token_cost(q: Any, k: Any, v: Any, g: Any, beta: Any, rows: Any, state_bytes: int) -> pl.CostEstimate:
    """The decode kernels' cost: the tokens' vectors and rows read, o written, `state_bytes` of states
    moved; per token and head 7 dk dv flops (decay, k^T S, the rank-1 update's product and sum, S^T q) and
    dk exps."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    n = b * t * h
    vectors = _nbytes(q, n * dk) + _nbytes(k, n * dk) + _nbytes(g, n * dk) + _nbytes(v, n * dv)
    vectors += _nbytes(beta, n) + _nbytes(rows, b) + _nbytes(v, n * dv)
    return pl.CostEstimate(
        flops=7 * n * dk * dv, transcendentals=n * dk, bytes_accessed=vectors + state_bytes
    )


def kda_decode_into_pool_cost(
    q: Any, k: Any, v: Any, g: Any, beta: Any, pool: Any, rows: Any
) -> pl.CostEstimate:
    """What :func:`kda_decode_into_pool_pallas` moves and computes: the rows' slots read and written (never
    the rest of the pool), the tokens' vectors, rows and o."""
    b, _, h, dk = q.shape
    slots = 2 * _nbytes(pool, b * h * dk * v.shape[-1])
    return _token_cost(q, k, v, g, beta, rows, slots)


def kda_decode_states_cost(
    q: Any, k: Any, v: Any, g: Any, beta: Any, pool: Any, rows: Any
) -> pl.CostEstimate:
    """What :func:`kda_decode_states_pallas` moves and computes: the rows' slots read once, an fp32 state
    written per token, the tokens' vectors, rows and o."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    return _token_cost(q, k, v, g, beta, rows, _nbytes(pool, b * h * dk * dv) + b * t * h * dk * dv * 4)


def _heads_per_block(h: int, dk: int, dv: int) -> int:
    """The most heads (a divisor of h) whose fp32 states fit one decode block."""
    return max(n for n in range(1, h + 1) if h % n == 0 and (n == 1 or n * dk * dv * 4 <= _STATE_BLOCK_BYTES))


def _decode_dims(q, k, v, g, beta, pool, rows) -> tuple[int, int, int, int, int, int]:
    """The decode kernels' (B, T, H, dk, dv, heads per block), the shapes checked."""
    _check_shapes(q, k, v, g, beta, None)
    b, t, h, dk = q.shape
    if pool.ndim != 4 or pool.shape[1:] != (h, dk, v.shape[-1]) or rows.shape != (b,):
        raise ValueError(
            f"a pool [S, {h}, {dk}, {v.shape[-1]}] and rows [{b}] expected: {pool.shape}, {rows.shape}"
        )
    return b, t, h, dk, v.shape[-1], _heads_per_block(h, dk, v.shape[-1])


# ----------------------------------------------------------------------------- the kernels


def kda_chunked_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    chunk: int = 64,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`~jaxhybrid.ops.kda.kda_chunked` as one Pallas kernel: same shapes, dtypes and results (o
    [B, T, H, dv] in v.dtype, the final state [B, H, dk, dv] float32).

    Grid (B, H, N chunks), the chunk axis sequential: the state lives in VMEM scratch across a row's
    chunks (loaded from `initial_state` at the first, written out after the last), and each chunk's
    output includes the state's contribution. T is zero-padded to a multiple of the chunk (g = 0 and
    beta = 0 there leave the state unchanged); the chunk is :func:`_chunk_length`'s.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk < 1:
        raise ValueError(f"chunk must be positive; got {chunk}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    s0 = _init_state(initial_state, b, h, dk, dv)
    if t == 0:
        return jnp.zeros((b, 0, h, dv), v.dtype), s0
    c = _chunk_length(t, chunk)
    n = -(-t // c)
    pad = n * c - t

    def heads_major(x: jax.Array) -> jax.Array:
        """[B, T, H, ...] -> [B, H, N * C, ...], zero-padded along T."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x, 2, 1)

    qh, kh, vh, gh = (heads_major(x) for x in (q, k, v, g))
    betah = heads_major(beta.astype(_F32)).reshape(b, h, n, c)  # fp32: one row a chunk, read by index
    token_block = lambda d: pl.BlockSpec((None, None, c, d), lambda bi, hi, ni: (bi, hi, ni, 0))  # noqa: E731
    whole = lambda shape: pl.BlockSpec((None, None) + shape, lambda bi, hi, ni: (bi, hi, 0, 0))  # noqa: E731
    o, s_final = pl.pallas_call(
        _chunk_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, h, n * c, dv), v.dtype),
            jax.ShapeDtypeStruct((b, h, dk, dv), _F32),
        ),
        grid=(b, h, n),
        in_specs=[
            token_block(dk),
            token_block(dk),
            token_block(dv),
            token_block(dk),
            whole((n, c)),
            whole((dk, dv)),
        ],
        out_specs=[token_block(dv), whole((dk, dv))],
        scratch_shapes=[pltpu.VMEM((dk, dv), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=kda_chunked_cost(q, k, v, g, beta, chunk),
        interpret=interpret,
    )(qh, kh, vh, gh, betah, s0)
    return jnp.moveaxis(o, 1, 2)[:, :t], s_final


def _token_operands(q, k, v, g, beta) -> tuple[jax.Array, ...]:
    """The per-token vectors as [B, T, H, 1, d] (beta [B, T, H, 1, 1]): a (1, d) row per head."""
    return tuple(x.reshape(x.shape[:3] + (1, -1)) for x in (q, k, v, g, beta))


def _row_spec(hb: int, d: int, index: Any) -> pl.BlockSpec:
    """The BlockSpec of hb heads' (1, d) rows of a [B, T, H, 1, d] array at `index` (grid indices and the
    prefetched rows -> (row, token, head block))."""
    return pl.BlockSpec((None, None, hb, 1, d), lambda *a: index(*a) + (0, 0))


def _token_specs(hb: int, dk: int, dv: int, index: Any) -> list[pl.BlockSpec]:
    """The BlockSpecs of q, k, v, g and beta's rows (:func:`_row_spec`)."""
    return [_row_spec(hb, d, index) for d in (dk, dk, dv, dk, 1)]


def kda_decode_into_pool_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`~jaxhybrid.ops.kda.kda_decode_into_pool_reference` as one Pallas kernel: one token per row
    (T == 1) from the states `pool[rows]` (pool [S, H, dk, dv], rows [B] int32, distinct and in range);
    returns (o [B, 1, H, dv] in v.dtype, the pool with each row's new state in its slot).

    Grid (B, head blocks). `rows` is prefetched into SMEM and the pool's BlockSpec reads and writes block
    ``pool[rows[b], heads]``; the pool is aliased to the second result, so a caller that donates it gets
    it updated in place (otherwise XLA copies it once, before the kernel).
    """
    b, t, h, dk, dv, hb = _decode_dims(q, k, v, g, beta, pool, rows)
    if t != 1:
        raise ValueError(f"one token per row expected; got T={t}")
    slot = pl.BlockSpec((None, hb, dk, dv), lambda bi, j, at: (at[bi], j, 0, 0))
    o, new = pl.pallas_call(
        _pool_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, 1, h, 1, dv), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, h // hb),
            in_specs=_token_specs(hb, dk, dv, lambda bi, j, at: (bi, 0, j)) + [slot],
            out_specs=[_row_spec(hb, dv, lambda bi, j, at: (bi, 0, j)), slot],
        ),
        input_output_aliases={6: 1},  # (rows, q, k, v, g, beta, pool): the pool is the second result
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=kda_decode_into_pool_cost(q, k, v, g, beta, pool, rows),
        interpret=interpret,
    )(rows.astype(jnp.int32), *_token_operands(q, k, v, g, beta), pool)
    return o.reshape(b, 1, h, dv), new


def kda_decode_states_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    pool: jax.Array,
    rows: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``kda_recurrent_states(q, k, v, g, beta, pool[rows])`` as one Pallas kernel (the verify step's few
    tokens per row): (o [B, T, H, dv] in v.dtype, the state after every token [B, T, H, dk, dv] float32).
    The pool is only read (rows in range); each state is written once, in its final layout.

    Grid (B, head blocks, T), tokens in order: the heads' states in VMEM scratch, loaded from the row's
    slot (found through the prefetched `rows`) at the first token.
    """
    b, t, h, dk, dv, hb = _decode_dims(q, k, v, g, beta, pool, rows)
    if t == 0:
        return jnp.zeros((b, 0, h, dv), v.dtype), jnp.zeros((b, 0, h, dk, dv), _F32)
    at_token = lambda bi, j, ti, at: (bi, ti, j)  # noqa: E731
    o, states = pl.pallas_call(
        _states_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, t, h, 1, dv), v.dtype),
            jax.ShapeDtypeStruct((b, t, h, dk, dv), _F32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, h // hb, t),
            in_specs=_token_specs(hb, dk, dv, at_token)
            + [pl.BlockSpec((None, hb, dk, dv), lambda bi, j, ti, at: (at[bi], j, 0, 0))],
            out_specs=[
                _row_spec(hb, dv, at_token),
                pl.BlockSpec((None, None, hb, dk, dv), lambda bi, j, ti, at: (bi, ti, j, 0, 0)),
            ],
            scratch_shapes=[pltpu.VMEM((hb, dk, dv), _F32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=kda_decode_states_cost(q, k, v, g, beta, pool, rows),
        interpret=interpret,
    )(rows.astype(jnp.int32), *_token_operands(q, k, v, g, beta), pool)
    return o.reshape(b, t, h, dv), states

"""Paged MLA decode as a Pallas TPU kernel: :func:`mla_paged_decode_pallas` equals
`jaxhybrid.ops.mla.mla_attention_paged_reference` (same signature, plus ``interpret``) without the reference's
gathered copy of every row's view of the pool.

Absorbed MLA decode is attention with one latent KV head: the keys are the pool's latents ``[c, k_r]``
(``R + rope`` wide), the values their first ``R`` dims, and the ``H`` queries of a token are
``[W_uk_h^T q_nope_h, q_rope_h]``. Outside the kernel (plain XLA, a few small products per step): the
absorption of ``W_uk`` into the queries and of ``W_uv`` into the output, and dequantizing int8 ``kv_b`` codes.
Inside: the attention of the ``T x H`` queries of a row over the positions its block table names.

Why a kernel of our own and not JAX's (jax.experimental.pallas.ops.tpu, 0.10.2):

- ``ragged_paged_attention`` reads K and V from one ``[pages, page_size, 2 * kv_heads, head_dim]`` array, K
  and V interleaved as heads of the same width. Our pool holds one ``R + rope`` latent a position, read as
  both; handing it over would need the pool rebuilt in that layout (a copy of the whole pool every step, or
  a pool twice the size), with V padded to K's width.
- ``paged_attention`` takes K and V as two arrays of one shape (the pool could be passed as both, but each
  block is then read twice, once per DMA), and one query token a row: T > 1 tokens (a verify step) would be
  B * T rows, each reading its row's blocks again (T times the reads), and a row's tokens could not share
  the latent. It has no interpret mode, so it could not be tested here against the reference.

The kernel: a grid over (rows, steps of k blocks of the row's table), the second sequential, k =
`blocks_per_step` (about 512 positions: a grid step has a fixed cost on a TPU, and one block is small). The
flattened block table and the per-token ends arrive through scalar prefetch (SMEM; rows go in groups whose
table fits it, a call a group), and each pool block ``[block_size, R + rope]`` is read in place by a
BlockSpec whose index map looks the block up in the table (the pool is passed k times, one input a block of
the step: no gathered view, no copy). Past the row's last needed block (``max_t end[b, t]``) an input names
its last block again, which the pipeline does not fetch twice, and the step skips the arithmetic. All ``T *
H`` queries of the row attend at once (the latent is shared by the heads and the tokens: each block is read
once a row), position ``p`` visible to token ``t`` iff ``p < end[b, t]``, with an online softmax (running
max, sum and ``[T * H, R + rope]`` accumulator in VMEM scratch), normalised at the row's last step. The
product with the values runs over the full latent width (a block is not split at ``R`` inside the kernel,
which Mosaic would have to relayout), and the ``rope`` columns of the result are dropped outside.

The pool must be in HBM in the row-major layout Mosaic reads. Compiled for a TPU, XLA gives a latent pool
whose width is not a multiple of 128 another layout (blocks minor: tiny-k3's 40 and K3's 576 alike), and
then copies the whole pool into Mosaic's for each call (tiny-k3's decode at 8,760 slots: 22 GB of
temporaries instead of the reference's 35 GB). With a 128-wide latent the layout is row-major and the
decode holds no copy (tiny-k3 with kv_lora_rank 120 at the plan's 2,760 slots on v5e: 0.26 GB of
temporaries against the reference's 3.70 GB). The pool's layout is the engine's to fix (pinned row-major,
or the latent padded to a multiple of 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxhybrid.ops import int8
from jaxhybrid.ops.mla import _split_kv_b, _token_ends
from jaxhybrid.ops.precision import einsum_f32

__all__ = [
    "blocks_per_step",
    "mla_paged_decode_blocks_read",
    "mla_paged_decode_cost",
    "mla_paged_decode_pallas",
]

# Bytes of scalar prefetch (block table and ends, int32) one kernel call takes: half of the 1 MiB of SMEM a
# v5e core has (Mosaic: "Allocation (size=8970240) would exceed memory (size=1048576)" for tiny-k3's 8,760
# rows of 256 entries in one call). More rows go through several calls.
SMEM_PREFETCH_BYTES = 512 * 1024
POSITIONS_PER_STEP = 512  # pool positions a grid step reads (`blocks_per_step`)


def mla_paged_decode_pallas(
    q: jax.Array,
    pool: jax.Array,
    block_table: jax.Array,
    end: jax.Array,
    kv_b_weight: jax.Array | int8.Int8,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
    interpret: bool = False,
) -> jax.Array:
    """`mla_attention_paged_reference` (q ``[B, T, H, nope + rope]``, pool ``[num_blocks, block_size, R +
    rope]``, block_table ``[B, W]``, end ``[B, T]`` or ``[B]``) with the attention over the pool in a Pallas
    kernel that reads the pool's blocks in place (module docstring). ``interpret=True`` runs the kernel in
    Pallas's interpreter (any backend; what the tests do on CPUs). On a TPU mesh call it inside
    ``jax.shard_map``: Mosaic kernels are not partitioned automatically. The module docstring says why this
    is a kernel of our own and not JAX's paged attention. Returns ``[B, T, H, v]`` in
    q.dtype; a token with ``end = 0`` gives zeros."""
    if isinstance(kv_b_weight, int8.Int8):
        kv_b_weight = int8.dequantize(kv_b_weight, q.dtype)
    # the shapes checked against an empty slice of the pool (its split halves are not wanted here)
    q_nope, q_rope, _, _, w_uk, w_uv = _split_kv_b(q, pool[:0], kv_b_weight, nope_dim, v_dim)
    b, t, h, _ = q.shape
    rank = kv_b_weight.shape[1]
    q_lat = einsum_f32("bthn,hnr->bthr", q_nope, w_uk).astype(q.dtype)
    queries = jnp.concatenate([q_lat, q_rope.astype(q.dtype)], axis=-1).reshape(b, t * h, pool.shape[-1])
    table, ends = jnp.asarray(block_table, jnp.int32), _token_ends(end, t)
    # rows in groups whose table and ends fit SMEM_PREFETCH_BYTES: one kernel call a group, each over the same
    # pool (nothing of it copied), unrolled (a loop's body would count once in XLA's cost analysis)
    per_call = max(1, SMEM_PREFETCH_BYTES // (4 * (table.shape[1] + t)))
    outs = [
        _paged_attention(
            queries[lo : lo + per_call],
            pool,
            table[lo : lo + per_call],
            ends[lo : lo + per_call],
            heads=h,
            scale=scale,
            interpret=interpret,
        )
        for lo in range(0, b, per_call)
    ]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    out_lat = out.reshape(b, t, h, pool.shape[-1])[..., :rank]
    return einsum_f32("bthr,hvr->bthv", out_lat, w_uv).astype(q.dtype)


def mla_paged_decode_cost(
    q_shape: tuple[int, ...],
    pool_shape: tuple[int, ...],
    table_shape: tuple[int, ...],
    *,
    q_dtype: jnp.dtype,
    pool_dtype: jnp.dtype,
) -> pl.CostEstimate:
    """The kernel's cost from the blocks it reads, static: every one of a row's ``W`` table entries (the ends
    are traced values, unknown when the call is built, so this is the most the kernel reads; a call with
    known ends reads `mla_paged_decode_blocks_read` blocks). Shapes are the public op's: q ``[B, T, H, .]``,
    pool ``[num_blocks, block_size, L]``, table ``[B, W]``. Bytes: the pool blocks, the ``[B, T * H, L]``
    queries in and attention out (q's dtype), the table and ``[B, T]`` ends (int32). Flops: the scores and
    the values' product, each ``2 * T * H * L`` a key; transcendentals: one exponential a score and one
    rescale a query and block."""
    b, t, h = q_shape[:3]
    _, block_size, width = pool_shape
    w = table_shape[1]
    keys = b * w * block_size
    q_bytes = b * t * h * width * jnp.dtype(q_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * 2 * t * h * width * keys,
        transcendentals=t * h * keys + b * w * t * h,
        bytes_accessed=keys * width * jnp.dtype(pool_dtype).itemsize + 2 * q_bytes + 4 * b * (w + t),
    )


def mla_paged_decode_blocks_read(block_table: np.ndarray, end: np.ndarray, block_size: int) -> int:
    """Pool blocks the kernel fetches for these concrete inputs, at most: each row's table entries up to the
    one holding its last visible position (``max_t end[b, t]``; the first entry if none), and at least one a
    pool input (`blocks_per_step` of them): the pipeline fetches what each input's first step of a row
    names. Fewer when consecutive steps name the same block (the pipeline keeps the one it has)."""
    table = np.asarray(block_table)
    rows, width = table.shape
    last = np.asarray(end).reshape(rows, -1).max(axis=1)
    needed = np.clip(-(-last // block_size), 1, width)
    return int(np.maximum(needed, blocks_per_step(width, block_size)).sum())


def blocks_per_step(table_width: int, block_size: int) -> int:
    """Pool blocks one grid step reads: about `POSITIONS_PER_STEP` positions, at most the table's width. A
    step costs a fixed fraction of a microsecond on a TPU whatever it reads, and one block is small (tiny-k3:
    16 positions of 40 latents, 1.3 KB; K3: 64 of 576, 74 KB)."""
    return max(1, min(table_width, POSITIONS_PER_STEP // block_size))


def _paged_attention(
    queries: jax.Array,
    pool: jax.Array,
    table: jax.Array,
    ends: jax.Array,
    *,
    heads: int,
    scale: float,
    interpret: bool,
) -> jax.Array:
    """Softmax attention of queries ``[B, T * H, L]`` over the pool positions each row's table names, keys
    and values both the whole latent, as one kernel call (the table and ends fit SMEM); ``[B, T * H, L]`` in
    the queries' dtype. The pool is passed once per block a step reads (the same buffer k times, each with
    its own index map: input j of step s reads the row's table entry ``s * k + j``)."""
    b, rows, width = queries.shape
    num_blocks, block_size, _ = pool.shape
    w = table.shape[1]
    tokens = ends.shape[1]
    k = blocks_per_step(w, block_size)

    def row_end(bi, ends_ref):
        """The end of the row's last visible position over its tokens, within its table (an end past the
        table sees the table's positions, as in the reference)."""
        last = functools.reduce(jnp.maximum, [ends_ref[bi * tokens + i] for i in range(tokens)])
        return jnp.minimum(last, w * block_size)

    def pool_block(j):
        def index(bi, si, table_ref, ends_ref):
            # input j reads entries j, j + k, ... up to the row's last needed one (the one holding its last
            # visible position, or the first if none), then names that one again: the pipeline fetches a
            # block only when its index changes, so a row costs max(its blocks, k) fetches
            last = jnp.maximum(row_end(bi, ends_ref) - 1, 0) // block_size
            steps = jnp.maximum((last - j) // k, 0)
            entry = jnp.minimum(jnp.minimum(si, steps) * k + j, last)
            return jnp.clip(table_ref[bi * w + entry], 0, num_blocks - 1), 0, 0

        return pl.BlockSpec((None, block_size, width), index)

    def row_map(bi, si, table_ref, ends_ref):
        return bi, 0, 0

    kernel = functools.partial(
        _kernel, heads=heads, tokens=tokens, block_size=block_size, scale=scale, row_end=row_end
    )
    cost = mla_paged_decode_cost(
        (b, tokens, heads), pool.shape, table.shape, q_dtype=queries.dtype, pool_dtype=pool.dtype
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, -(-w // k)),
            in_specs=[pl.BlockSpec((None, rows, width), row_map)] + [pool_block(j) for j in range(k)],
            out_specs=pl.BlockSpec((None, rows, width), row_map),
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),  # running max of the visible scores
                pltpu.VMEM((rows, 1), jnp.float32),  # running sum of their exponentials
                pltpu.VMEM((rows, width), jnp.float32),  # running weighted sum of the latents
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="mla_paged_decode",
    )(table.reshape(-1), ends.reshape(-1), queries, *[pool] * k)


def _kernel(table_ref, ends_ref, q_ref, *refs, heads, tokens, block_size, scale, row_end):
    """One (row, step of k table entries) of `_paged_attention`'s grid: the online softmax over each of
    the step's k blocks in turn. `refs`: the k pool blocks, the output, then the scratch (max, sum,
    accumulator)."""
    del table_ref  # read by the pool's index maps
    *pool_refs, o_ref, m_ref, l_ref, acc_ref = refs
    k = len(pool_refs)
    bi, si = pl.program_id(0), pl.program_id(1)
    rows = q_ref.shape[0]

    @pl.when(si == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    last = row_end(bi, ends_ref)
    # query row r is token r // H; its end from the prefetched scalars
    token = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // heads
    token_end = jnp.zeros((rows, 1), jnp.int32)
    for i in range(tokens):
        token_end = jnp.where(token == i, ends_ref[bi * tokens + i], token_end)

    for j, pool_ref in enumerate(pool_refs):
        first = (si * k + j) * block_size  # the block's first position in the row

        @pl.when(first < last)
        def _block(pool_ref=pool_ref, first=first):
            q = q_ref[...]
            # positions no token of the row sees are zeroed: whatever they hold (a block's unwritten tail)
            # cannot reach the output, not even as 0 * NaN in the values' product
            seen = first + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0) < last
            keys = jnp.where(seen, pool_ref[...], 0).astype(q.dtype)
            scores = jax.lax.dot_general(
                q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            scores = scores * scale  # [T * H, block_size]
            visible = first + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1) < token_end
            scores = jnp.where(visible, scores, -jnp.inf)
            m_prev = m_ref[...]
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a query with nothing visible yet
            p = jnp.where(visible, jnp.exp(scores - shift), 0.0)
            alpha = jnp.exp(m_prev - shift)
            l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
            pv = jax.lax.dot_general(
                p.astype(keys.dtype), keys, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_ref[...] = alpha * acc_ref[...] + pv
            m_ref[...] = m_next

    @pl.when(si == pl.num_programs(1) - 1)
    def _finish():
        total = l_ref[...]
        inv = 1.0 / jnp.where(total > 0, total, 1.0)
        o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)

"""Grouped expert matmul for TPU: rows sorted by expert times each expert's weight, the weight dense or
MXFP4-packed, equal to :func:`jaxhybrid.ops.moe.grouped_matmul` (XLA's ``ragged_dot`` over the dequantized
weight).

Dense (bf16 / f32) experts go through JAX's megablox ``gmm``: it takes the same inputs (rows sorted by
group, group sizes, a weight [G, out, in] read transposed) and reads only the groups with rows. (Its result
does not say how it varies over a shard_map's axes, so inside one it needs ``check_vma=False``.)

Packed experts have no kernel in JAX that reads them packed (``gmm`` and tokamax's ``ragged_dot`` take
float weights, so XLA would dequantize every expert a step uses into HBM first), hence
:func:`grouped_matmul`'s own kernel, laid out like ``gmm``: scalar-prefetched group metadata names the
expert and row tile of every grid step (only steps of experts with rows exist), and the weight's BlockSpec
picks the expert's codes and E8M0 scales by that id, so consecutive steps on one expert reuse the block in
VMEM and an expert without rows is never read. Each step dequantizes its tile of codes in VMEM and
multiplies; no dequantized expert is written to HBM.

The codes' layout is `jaxhybrid.ops.mxfp4`'s: byte i of a row holds column 2i in its low nibble and 2i + 1
in its high one, and scale j covers columns 32j..32j + 31 (bytes 16j..16j + 15). Interleaving the two
nibbles back into columns is a lane reshape Mosaic does not lower, so the rows are split instead, outside
the kernel (activations, a small copy): ``x @ W.T = x[:, 0::2] @ low.T + x[:, 1::2] @ high.T``, where
``low``/``high`` are the nibbles' values times the scale of their byte (byte i: scale i // 16).

Mosaic kernels compile only where the program's arrays are local to each device (inside ``shard_map``, or
a single device); elsewhere the callers keep XLA's form (:func:`jaxhybrid.ops.moe.grouped_matmul_for`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxhybrid.ops import mxfp4
from jaxhybrid.ops.mxfp4 import MXFP4

__all__ = ["KERNEL_NAME", "Tiling", "cost_estimate", "grouped_matmul", "tiling"]

KERNEL_NAME = "mxfp4_grouped_matmul"  # the packed kernel's name in a compiled module

# The kernel module itself (the package's `gmm` attribute is the function, which shadows the module).
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

# Rows of lhs per tile, at most (a prompt's many rows an expert); fewer where experts get fewer (`tiling`).
MAX_TILE_ROWS = 128
# Weight bytes (codes, or a dense weight's elements) of one tile, at most. Dequantizing a packed tile makes
# about 20 bytes of VMEM temporaries per code byte (int32 codes, float32 values of both nibbles, their
# scales, the bf16 products), so 256 KiB of codes stays within the 16 MiB VMEM a TPU kernel gets by default
# on every generation, double buffering included.
MAX_TILE_WEIGHT_BYTES = 256 * 1024
_LANES = 128  # a tile's output columns are a multiple of this, or all of them
_ROW_ALIGN = 16  # bf16 rows fill a TPU tile's sublanes in pairs: a tile of rows is a multiple of 16


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Rows per tile `tm` (rows are padded to `rows`, a multiple of it) and output columns per tile `tn`;
    each tile takes the whole input dimension."""

    tm: int
    tn: int
    rows: int

    @property
    def row_tiles(self) -> int:
        return self.rows // self.tm


def tiling(m: int, k: int, n: int, groups: int, weight_row_bytes: int) -> Tiling:
    """The tiles for `m` rows [m, k] over `groups` weights [n, k] whose rows take `weight_row_bytes` each
    (k / 2 for packed codes). Rows: about the rows an expert gets on average, in multiples of 16, at most
    `MAX_TILE_ROWS`: every step multiplies its whole row tile, so a decode step's one or two rows an expert
    take a tile of 16, not 128 (8x fewer products; the weight tile is read once either way). Output columns:
    the widest tile that divides n in multiples of 128 columns (all n if it fits) within
    `MAX_TILE_WEIGHT_BYTES`."""
    del k
    rows = max(m, 1)
    per_group = -(-rows // max(1, min(groups, rows)))
    tm = min(MAX_TILE_ROWS, -(-per_group // _ROW_ALIGN) * _ROW_ALIGN)
    fits = max(1, MAX_TILE_WEIGHT_BYTES // weight_row_bytes)
    if n <= fits:
        tn = n
    else:
        widths = [w for w in range(_LANES, min(n, fits) + 1, _LANES) if n % w == 0]
        tn = widths[-1] if widths else _LANES
    return Tiling(tm, tn, -(-rows // tm) * tm)


def cost_estimate(
    m: int, k: int, n: int, groups: int, lhs_dtype: Any, out_dtype: Any = jnp.float32
) -> pl.CostEstimate:
    """What the packed kernel reads and writes for `m` rows [m, k] over `groups` packed experts [n, k], at
    most, counted from its blocks: per output tile, each expert with rows (at most min(groups, m)) has its
    codes [tn, k/2] and scales [tn, k/32] fetched once, and each row tile [tm, k] once; each output tile
    [tm, tn] is written once; and the group metadata (int32: groups + 1 offsets, an expert and a row tile
    for each of the row tiles + groups - 1 steps there can be). Flops: each step multiplies a row tile by a
    weight tile, and there are at most row tiles + min(groups, m) - 1 steps per output tile (a group
    starting inside a row tile visits it once more)."""
    t = tiling(m, k, n, groups, k // 2)
    col_tiles = -(-n // t.tn)
    used = max(1, min(groups, m))
    weights = col_tiles * used * t.tn * (k // 2 + k // mxfp4.GROUP)
    lhs = col_tiles * t.rows * k * jnp.dtype(lhs_dtype).itemsize
    out = t.rows * col_tiles * t.tn * jnp.dtype(out_dtype).itemsize
    metadata = 4 * (groups + 1 + 2 * (t.row_tiles + groups - 1))
    steps = col_tiles * (t.row_tiles + used - 1)
    return pl.CostEstimate(
        flops=2 * steps * t.tm * t.tn * k,
        transcendentals=0,
        bytes_accessed=weights + lhs + out + metadata,
    )


def grouped_matmul(
    lhs: jax.Array, w: jax.Array | MXFP4, group_sizes: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """Rows `lhs` [M, K] sorted by group, `group_sizes` [G] int32 rows of each (summing to at most M),
    times each group's weight `w` [G, N, K] (dense, or MXFP4 codes and scales) transposed: [M, N] float32,
    rows past the groups zero. Equals :func:`jaxhybrid.ops.moe.grouped_matmul`. `interpret` runs the kernel
    in Pallas's interpreter (any backend; for tests)."""
    m, k = lhs.shape
    groups, n = w.shape[0], w.shape[1]
    if w.shape != (groups, n, k) or group_sizes.shape != (groups,):
        raise ValueError(
            f"grouped_matmul takes lhs [M, K], w [G, N, K], sizes [G]; got {lhs.shape}, "
            f"{w.shape}, {group_sizes.shape}"
        )
    group_sizes = group_sizes.astype(jnp.int32)
    packed = isinstance(w, MXFP4)
    t = tiling(m, k, n, groups, k // 2 if packed else k * jnp.dtype(w.dtype).itemsize)
    rows = jnp.pad(lhs, ((0, t.rows - m), (0, 0)))
    if packed:
        out = _packed_gmm(rows, w, group_sizes, t, m, interpret)
    else:
        tk = k if k <= 4 * _LANES or k % _LANES else 4 * _LANES
        out = megablox.gmm(
            rows.astype(jnp.promote_types(lhs.dtype, w.dtype)),
            w.astype(jnp.promote_types(lhs.dtype, w.dtype)),
            group_sizes,
            preferred_element_type=jnp.float32,
            tiling=(t.tm, tk, t.tn),
            transpose_rhs=True,
            interpret=interpret,
        )
    # Tiles past the groups are never visited (their output is whatever the buffer held): zero those rows.
    filled = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(filled[:, None], out[:m], 0.0)


def _packed_gmm(
    rows: jax.Array, w: MXFP4, group_sizes: jax.Array, t: Tiling, m: int, interpret: bool
) -> jax.Array:
    """The kernel over `m` rows padded to [t.rows, K]: grid (output column tile, step), one step per (expert
    with rows, row tile it touches), consecutive in expert order (`group_metadata`)."""
    groups, n, half = w.packed.shape
    k = 2 * half
    (offsets, group_ids, row_tiles), steps = group_metadata(group_sizes, t)
    even, odd = rows[:, 0::2], rows[:, 1::2]  # the columns of the codes' low and high nibbles

    def row_block(j, i, offsets, group_ids, row_tiles):
        return row_tiles[i], 0

    def weight_block(j, i, offsets, group_ids, row_tiles):
        return group_ids[i], j, 0

    def out_block(j, i, offsets, group_ids, row_tiles):
        return row_tiles[i], j

    col_tiles = -(-n // t.tn)
    # Inside a shard_map that checks what varies over its axes, the result varies as its operands do.
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in (rows, w.packed, w.scale, group_sizes)))
    out_shape = jax.ShapeDtypeStruct(
        (t.rows, n), jnp.float32, manual_axis_type=jax.sharding.ManualAxisType(varying=varying)
    )
    return pl.pallas_call(
        _packed_kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(col_tiles, steps),
            in_specs=[
                pl.BlockSpec((t.tm, half), row_block),
                pl.BlockSpec((t.tm, half), row_block),
                pl.BlockSpec((None, t.tn, half), weight_block),
                pl.BlockSpec((None, t.tn, k // mxfp4.GROUP), weight_block),
            ],
            out_specs=pl.BlockSpec((t.tm, t.tn), out_block),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost_estimate(m, k, n, groups, rows.dtype),
        interpret=interpret,
        name=KERNEL_NAME,
    )(offsets, group_ids, row_tiles, even, odd, w.packed, w.scale)


def group_metadata(group_sizes: jax.Array, t: Tiling) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """((row offset of each group [G + 1], expert [S] and row tile [S] of each step), the steps to run):
    megablox's `make_group_metadata`, the steps of experts with rows only, in expert order."""
    return megablox.make_group_metadata(
        group_sizes=group_sizes,
        m=t.rows,
        tm=t.tm,
        start_group=jnp.zeros((), jnp.int32),
        num_nonzero_groups=group_sizes.shape[0],
        visit_empty_groups=False,
    )


def _packed_kernel(offsets, group_ids, row_tiles, even_ref, odd_ref, codes_ref, scale_ref, out_ref):
    """One step: the row tile times its expert's tile of codes, dequantized here (`mxfp4`'s decoding), kept
    for the rows of this step's expert. A row tile's other rows belong to the experts of its other steps
    (consecutive) or to no expert (past the groups, zeroed after the call)."""
    i = pl.program_id(1)
    tm, tn = out_ref.shape
    codes = codes_ref[...].astype(jnp.int32)  # Mosaic shifts 32-bit lanes, not bytes
    factor = jnp.repeat(mxfp4._scale_factor(scale_ref[...]), mxfp4.GROUP // 2, axis=1)  # per byte
    dtype = even_ref.dtype
    low = (mxfp4._e2m1(codes & 0xF) * factor).astype(dtype)  # exact: E2M1 times a power of two
    high = (mxfp4._e2m1(codes >> 4) * factor).astype(dtype)
    y = _times_transposed(even_ref[...], low) + _times_transposed(odd_ref[...], high)

    group = group_ids[i]
    row = row_tiles[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    mine = (row >= offsets[group]) & (row < offsets[group + 1])
    out_ref[...] = jnp.where(mine, y, out_ref[...])


def _times_transposed(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b[n, k].T in float32: exact float32 products for float32 operands, the MXU's bf16 ones
    otherwise (named, so that a program-wide HIGHEST default does not ask Mosaic for bf16 at HIGHEST)."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return jax.lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT,
        preferred_element_type=jnp.float32,
    )

"""Weight-only int8: a weight W [.., out, in] held as int8 codes and one float32 scale per output channel,
``W ~= q * scale[..., None]``, and its product with float activations.

Two products share one signature, ``(x [..., in], w: Int8, index=None) -> [..., out] float32``:

* :func:`matmul_reference` - dequantize the matrix, then a float32 product. The reference.
* :func:`matmul` - on the CPU, rows go through the int8 kernel of `jaxhybrid.ops.native`, which reads the
  codes in place: a decode-sized batch (up to :data:`KERNEL_ROWS`) reads each weight byte once, a prompt's
  rows take its blocked matrix product (AVX-512). Without that product, a prompt dequantizes one block of
  :data:`BLOCK` output channels at a time inside a loop, so no float32 copy of a whole matrix is written
  per call. Elsewhere (accelerators, or no kernel) it is the reference. The results differ from the
  reference only in the order of float32 sums.

``index`` picks one matrix of a stack (an expert [E, out, in], or (group, expert) of [G, E, out, in]) in
place: the kernel reads it where it lies, nothing is sliced out first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.ops import native, registry
from jaxhybrid.ops.stacks import flat_index, take_leading

__all__ = [
    "Int8",
    "quantize",
    "dequantize",
    "matmul",
    "matmul_reference",
    "matmul_pairs",
    "matmul_pairs_reference",
    "matmul_many",
    "matmul_many_reference",
    "matmul_pairs_many",
    "matmul_pairs_many_reference",
    "KERNEL_ROWS",
    "BLOCK",
    "kernel_takes",
]

KERNEL_ROWS = 16  # up to this many rows the kernel (one read of the weights); past that the blocked product
BLOCK = 1024  # at most this many output channels dequantized at a time by the blocked product
QMAX = 127  # symmetric codes -127..127


class Int8(NamedTuple):
    """An int8 weight (or a stack of them): `q` int8 [.., out, in], `scale` float32 [.., out]."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return self.q.ndim


def quantize(w: jax.Array) -> Int8:
    """Symmetric per-output-channel codes: scale = max |w[o, :]| / 127 (1 for an all-zero row), codes
    round(w / scale) to the nearest, ties to even."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / scale[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return Int8(q, scale)


def dequantize(w: Int8, dtype: Any = jnp.float32) -> jax.Array:
    return (w.q.astype(jnp.float32) * w.scale[..., None]).astype(dtype)


def select(w: Int8, index: Any) -> Int8:
    """Matrix `index` of a stack (an index or a tuple of them over the leading dims), as a slice."""
    if index is None:
        return w
    return Int8(take_leading(w.q, index), take_leading(w.scale, index))


def flatten(w: Int8) -> Int8:
    """A stack [.., out, in] as [S, out, in] (a free reshape; one matrix: S = 1): what the kernel reads."""
    lead = w.q.shape[:-2]
    return Int8(w.q.reshape(math.prod(lead), *w.q.shape[-2:]), w.scale.reshape(math.prod(lead), -1))


def matmul_reference(x: jax.Array, w: Int8, index: Any = None) -> jax.Array:
    m = select(w, index)
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), dequantize(m), precision="highest")


def matmul_native(x: jax.Array, w: Int8, index: Any = None) -> jax.Array:
    """:func:`matmul_reference` through the native CPU kernel (the codes read in place)."""
    ids = flat_index(w.q.shape[:-2], index).reshape(1)
    (y,) = _kernel(x.reshape(-1, x.shape[-1]), [flatten(w)], ids)
    return y.reshape(*x.shape[:-1], w.q.shape[-2])


def matmul_native_applies(x: jax.Array, w: Int8, index: Any = None) -> bool:
    """Rows the kernel multiplies (:func:`kernel_takes`)."""
    return kernel_takes(math.prod(x.shape[:-1]))


def matmul_blocked(x: jax.Array, w: Int8, index: Any = None) -> jax.Array:
    """:func:`matmul_reference` block by block (`_blocked`): XLA:CPU's form without the kernel."""
    return _blocked(x, select(w, index))


MATMUL = registry.Op(
    "int8.matmul",
    matmul_reference,
    registry.Implementation(registry.Kind.XLA, matmul_blocked, registry.CPU),
    registry.cpu_kernel(matmul_native, matmul_native_applies),
)


def matmul(x: jax.Array, w: Int8, index: Any = None) -> jax.Array:
    """:func:`matmul_reference` as `jaxhybrid.ops.registry` chooses: in a program on CPUs through the kernel
    (decode-sized rows, or any with its blocked product) or block by block (:func:`matmul_blocked`);
    elsewhere the reference."""
    return MATMUL(x, w, index)


def matmul_many_reference(x: jax.Array, ws: Sequence[Int8]) -> tuple[jax.Array, ...]:
    """x [..., in] times each of several matrices [out_i, in] (the projections of one input)."""
    return tuple(matmul_reference(x, w) for w in ws)


def matmul_many_native(x: jax.Array, ws: Sequence[Int8]) -> tuple[jax.Array, ...]:
    """:func:`matmul_many_reference` as one native kernel call (the matrices' rows split over the threads)."""
    ys = _kernel(x.reshape(-1, x.shape[-1]), [flatten(w) for w in ws], jnp.zeros((1,), jnp.int32))
    return tuple(y.reshape(*x.shape[:-1], w.q.shape[-2]) for y, w in zip(ys, ws, strict=True))


def matmul_many_native_applies(x: jax.Array, ws: Sequence[Int8]) -> bool:
    return kernel_takes(math.prod(x.shape[:-1]))


def matmul_many_each(x: jax.Array, ws: Sequence[Int8]) -> tuple[jax.Array, ...]:
    """One :func:`matmul` each (XLA:CPU's form without the kernel: each block by block)."""
    return tuple(matmul(x, w) for w in ws)


MATMUL_MANY = registry.Op(
    "int8.matmul_many",
    matmul_many_reference,
    registry.Implementation(registry.Kind.XLA, matmul_many_each, registry.CPU),
    registry.cpu_kernel(matmul_many_native, matmul_many_native_applies),
)


def matmul_many(x: jax.Array, ws: Sequence[Int8]) -> tuple[jax.Array, ...]:
    """:func:`matmul_many_reference` as `jaxhybrid.ops.registry` chooses: one native kernel call on the CPU
    where it takes the rows, else one :func:`matmul` each there; elsewhere the reference."""
    return MATMUL_MANY(x, ws)


def matmul_pairs_reference(x: jax.Array, w: Int8, ids: jax.Array) -> jax.Array:
    """Row p of x [P, in] times matrix ids[p] of the stack w [E, out, in] -> [P, out] float32; a negative
    id gives a row of zeros."""
    take = jnp.clip(ids, 0, w.q.shape[0] - 1)
    dense = dequantize(Int8(w.q[take], w.scale[take]))
    y = jnp.einsum("pi,poi->po", x.astype(jnp.float32), dense, precision="highest")
    return jnp.where((ids >= 0)[:, None], y, 0.0)


def matmul_pairs(x: jax.Array, w: Int8, ids: jax.Array) -> jax.Array:
    """:func:`matmul_pairs_reference` with the rows' matrices read in place by the CPU kernel (one call for
    all rows, e.g. every (token, expert) pair of a decode step; each matrix in use read once for all its
    rows); elsewhere the reference."""
    return matmul_pairs_many(x, [w], ids)[0]


def matmul_pairs_many_reference(x: jax.Array, ws: Sequence[Int8], ids: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_reference` for each of several stacks of one E (an expert's projections)."""
    return tuple(matmul_pairs_reference(x, w, ids) for w in ws)


def matmul_pairs_many_native(x: jax.Array, ws: Sequence[Int8], ids: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_many_reference` as one native kernel call (each matrix in use read once)."""
    return tuple(_kernel(x, ws, ids))


def matmul_pairs_many_native_applies(x: jax.Array, ws: Sequence[Int8], ids: jax.Array) -> bool:
    return _target() is not None


MATMUL_PAIRS_MANY = registry.Op(
    "int8.matmul_pairs_many",
    matmul_pairs_many_reference,
    registry.cpu_kernel(matmul_pairs_many_native, matmul_pairs_many_native_applies),
)


def matmul_pairs_many(x: jax.Array, ws: Sequence[Int8], ids: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_many_reference` as `jaxhybrid.ops.registry` chooses: one native kernel call on the
    CPU; elsewhere the reference."""
    return MATMUL_PAIRS_MANY(x, ws, ids)


def _target() -> str | None:
    return native.int8_kernel()


def kernel_takes(rows: int) -> bool:
    """Whether the CPU kernel multiplies `rows` rows (reading the int8 weights in place): a decode-sized
    batch, or any number where it has its blocked matrix product; else `matmul` dequantizes its weights
    block by block."""
    return _target() is not None and (rows <= KERNEL_ROWS or native.gemm_rows() > 0)


def _kernel(x: jax.Array, ws: Sequence[Int8], ids: jax.Array) -> list[jax.Array]:
    """The FFI kernel: x [M, in] against matrix ids[0] of each w [S, out_i, in] for every row, or ids[m] for
    row m (ids [M]); -> [M, out_i] float32 for each w."""
    results = [jax.ShapeDtypeStruct((x.shape[0], w.q.shape[1]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(_target(), results, vmap_method="sequential")
    return call(x.astype(jnp.float32), ids.astype(jnp.int32), *(a for w in ws for a in (w.q, w.scale)))


def _block_size(out: int) -> int:
    """The largest divisor of `out` up to BLOCK (at least BLOCK / 4), else `out` itself (one block)."""
    return next((b for b in range(min(BLOCK, out), BLOCK // 4 - 1, -1) if out % b == 0), out)


def _blocked(x: jax.Array, w: Int8) -> jax.Array:
    """`x @ dequantize(w).T`, dequantizing a block of output channels at a time into a float32 buffer the
    product then reads (the barrier keeps XLA from fusing the conversion into the product, which XLA:CPU
    then runs as a loop without vectors, several times slower)."""
    out, cols = w.q.shape
    size = _block_size(out)
    x2 = x.reshape(-1, cols).astype(jnp.float32)

    def block(qs: tuple[jax.Array, jax.Array]) -> jax.Array:
        dense = jax.lax.optimization_barrier(dequantize(Int8(*qs)))
        return jnp.dot(x2, dense.T, precision="highest")

    blocks = (w.q.reshape(out // size, size, cols), w.scale.reshape(out // size, size))
    y = jax.lax.map(block, blocks)
    return jnp.moveaxis(y, 0, 1).reshape(*x.shape[:-1], out)

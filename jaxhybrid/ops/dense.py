"""Products with float weights W [.., out, in] (the layout of the checkpoints), with the signatures of the
int8 products in `jaxhybrid.ops.int8`:

* :func:`matmul_reference` / :func:`matmul`: ``(x [..., in], w, index=None) -> [..., out]``; ``index``
  picks one matrix of a stack (an expert of [E, out, in], or (group, expert) of [G, E, out, in]).
* :func:`matmul_many_reference` / :func:`matmul_many`: ``(x [..., in], [w_1, ..]) -> ([..., out_1], ..)``,
  the projections of one input as one kernel call.
* :func:`matmul_pairs_reference` / :func:`matmul_pairs`: row p of x [P, in] times matrix ids[p] of a stack
  [E, out, in] (a negative id: a row of zeros); `matmul_pairs_many` for several stacks at once.

On the CPU, float32 rows of a decode-sized batch (up to `int8.KERNEL_ROWS`) go through the float32 kernel
of `jaxhybrid.ops.native`, which splits every product over the intra-op threads and reads an expert where
it lies in its stack: XLA:CPU runs the products of a few MB (an expert, a shared expert, a low-rank
projection) on one thread, and copies an expert out of its stack before multiplying it (measured in
`git show 9bb8ba5:BENCHMARKS.md`, "Float32 decode products"). `matmul_pairs` takes any number of rows
there (a prompt's experts: a blocked matrix product over each expert in place, with AVX-512). Elsewhere,
and for other dtypes, the reference.
The two differ only in the order of float32 sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.ops import native, precision, registry
from jaxhybrid.ops.int8 import KERNEL_ROWS
from jaxhybrid.ops.stacks import flat_index, take_leading

__all__ = [
    "matmul",
    "matmul_reference",
    "matmul_many",
    "matmul_many_reference",
    "matmul_pairs",
    "matmul_pairs_reference",
    "matmul_pairs_many",
    "matmul_pairs_many_reference",
    "kernel_applies",
    "flatten",
]


def matmul_reference(x: jax.Array, w: jax.Array, index: Any = None) -> jax.Array:
    m = w if index is None else take_leading(w, index)
    return jnp.einsum("...i,oi->...o", x, m.astype(x.dtype), precision=precision.of(x, m))


def matmul_native(x: jax.Array, w: jax.Array, index: Any = None) -> jax.Array:
    """:func:`matmul_reference` through the native CPU kernel (matrix `index` read where it lies)."""
    (y,) = _kernel(x.reshape(-1, x.shape[-1]), [flatten(w)], flat_index(w.shape[:-2], index).reshape(1))
    return y.reshape(*x.shape[:-1], w.shape[-2])


def matmul_native_applies(x: jax.Array, w: jax.Array, index: Any = None) -> bool:
    """Decode-sized rows (up to `KERNEL_ROWS`) the kernel takes (:func:`kernel_applies`)."""
    return math.prod(x.shape[:-1]) <= KERNEL_ROWS and kernel_applies(x, w)


MATMUL = registry.Op(
    "dense.matmul", matmul_reference, registry.cpu_kernel(matmul_native, matmul_native_applies)
)


def matmul(x: jax.Array, w: jax.Array, index: Any = None) -> jax.Array:
    return MATMUL(x, w, index)


def matmul_many_reference(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """x [..., in] times each of several matrices [out_i, in] (the projections of one input)."""
    return tuple(matmul_reference(x, w) for w in ws)


def matmul_many_native(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """:func:`matmul_many_reference` as one native kernel call (the matrices' rows split over the threads as
    one product)."""
    ys = _kernel(x.reshape(-1, x.shape[-1]), [flatten(w) for w in ws], jnp.zeros((1,), jnp.int32))
    return tuple(y.reshape(*x.shape[:-1], w.shape[-2]) for y, w in zip(ys, ws, strict=True))


def matmul_many_native_applies(x: jax.Array, ws: Sequence[jax.Array]) -> bool:
    return math.prod(x.shape[:-1]) <= KERNEL_ROWS and all(kernel_applies(x, w) for w in ws)


MATMUL_MANY = registry.Op(
    "dense.matmul_many",
    matmul_many_reference,
    registry.cpu_kernel(matmul_many_native, matmul_many_native_applies),
)


def matmul_many(x: jax.Array, ws: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """:func:`matmul_many_reference` as `jaxhybrid.ops.registry` chooses: one native kernel call on the CPU
    for decode-sized float32 rows; else the reference."""
    return MATMUL_MANY(x, ws)


def matmul_pairs_reference(x: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    take = jnp.clip(ids, 0, w.shape[0] - 1)
    y = jnp.einsum("pi,poi->po", x, w[take].astype(x.dtype), precision=precision.of(x, w))
    return jnp.where((ids >= 0)[:, None], y, 0.0)


def matmul_pairs(x: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    """:func:`matmul_pairs_reference` with every row's matrix read in place by the CPU kernel (one call for
    all rows, each matrix in use read once for all its rows); elsewhere the reference."""
    return matmul_pairs_many(x, [w], ids)[0]


def matmul_pairs_many_reference(
    x: jax.Array, ws: Sequence[jax.Array], ids: jax.Array
) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_reference` for each of several stacks of one E (an expert's projections)."""
    return tuple(matmul_pairs_reference(x, w, ids) for w in ws)


def matmul_pairs_many_native(x: jax.Array, ws: Sequence[jax.Array], ids: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_many_reference` as one native kernel call (each matrix in use read once)."""
    return tuple(_kernel(x, ws, ids))


def matmul_pairs_many_native_applies(x: jax.Array, ws: Sequence[jax.Array], ids: jax.Array) -> bool:
    return all(kernel_applies(x, w) for w in ws)


MATMUL_PAIRS_MANY = registry.Op(
    "dense.matmul_pairs_many",
    matmul_pairs_many_reference,
    registry.cpu_kernel(matmul_pairs_many_native, matmul_pairs_many_native_applies),
)


def matmul_pairs_many(x: jax.Array, ws: Sequence[jax.Array], ids: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`matmul_pairs_many_reference` as `jaxhybrid.ops.registry` chooses: one native kernel call on the
    CPU; elsewhere the reference."""
    return MATMUL_PAIRS_MANY(x, ws, ids)


def kernel_applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether the CPU kernel takes these operands (float32 both, and the kernel built) in a program on CPUs
    (`placement` says where one runs); `matmul` takes it for up to `KERNEL_ROWS` rows, `matmul_pairs` for
    any number (its caller decides)."""
    return x.dtype == jnp.float32 and w.dtype == jnp.float32 and _target() is not None


def _target() -> str | None:
    return native.f32_kernel()


def flatten(w: jax.Array) -> jax.Array:
    """A stack [.., out, in] as [S, out, in] (one matrix: S = 1): what the kernel reads."""
    return w.reshape(math.prod(w.shape[:-2]), *w.shape[-2:])


def _kernel(x: jax.Array, ws: Sequence[jax.Array], ids: jax.Array) -> list[jax.Array]:
    """x [M, in] against matrix ids[0] of each w [S, out_i, in] for every row, or ids[m] for row m -> [M,
    out_i] for each w."""
    results = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(_target(), results, vmap_method="sequential")
    return call(x, ids.astype(jnp.int32), *ws)

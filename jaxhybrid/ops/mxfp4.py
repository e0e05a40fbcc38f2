"""MXFP4 weights kept packed (Kimi K3's routed experts): the format's constants, a pytree type for a packed
weight, and JAX dequantization / quantization. The NumPy functions in `jaxhybrid.weights.mxfp4` are the
reference (the checkpoint loader's exact dequantization).

A weight W [.., out, in] is two uint8 arrays: `packed` [.., out, in/2] (column 2i in the low nibble of byte
i, 2i+1 in the high nibble; a nibble is E2M1 with bit 3 the sign) and `scale` [.., out, in/32] (E8M0: the
power of two 2^(e - 127) of 32 columns). `W[o, c] = E2M1(code[o, c]) * 2^(scale[o, c // 32] - 127)`, exact
in float32 and bfloat16 within their range; scale 255 is NaN.

The expert implementations of `jaxhybrid.ops.moe` take an :class:`MXFP4` wherever they take a dense
stacked weight [E, out, in] and dequantize only the experts a step uses (:func:`expert_slice`,
:func:`as_dense`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.ops import int8
from jaxhybrid.ops.int8 import Int8
from jaxhybrid.ops.stacks import take_leading

__all__ = [
    "GROUP",
    "SCALE_BIAS",
    "SCALE_NAN",
    "E2M1_VALUES",
    "MXFP4",
    "dequantize",
    "matvec",
    "quantize",
    "as_dense",
    "expert_slice",
    "is_packed",
]

GROUP = 32  # columns per E8M0 scale
SCALE_BIAS = 127
SCALE_NAN = 255  # E8M0 NaN
# E2M1 code -> value; code 8 is -0.0.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


class MXFP4(NamedTuple):
    """A packed weight (or a stack of them): `packed` [.., out, in/2] and `scale` [.., out, in/32], uint8.

    `shape` is the logical (dequantized) shape [.., out, in], so shape checks treat it like the dense
    array it stands for."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    @property
    def ndim(self) -> int:
        return self.packed.ndim


ExpertWeight = jax.Array | MXFP4 | Int8  # dense, MXFP4-packed, or weight-only int8 (`jaxhybrid.ops.int8`)


def is_packed(w: Any) -> bool:
    return isinstance(w, MXFP4)


def _e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes (uint8 or wider, 0..15) -> float32 values, without a table lookup (a gather, slow on the
    CPU): each magnitude is built as float32 bits (exponent 127 + (m >> 1) - 1 and one mantissa bit for
    m >= 2; 0.5 for m = 1; 0 for m = 0), exactly as the table of `jaxhybrid.weights.mxfp4` gives."""
    c = codes.astype(jnp.uint32)
    m = c & 7
    normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    bits = jnp.where(m >= 2, normal, jnp.where(m == 1, jnp.uint32(126 << 23), jnp.uint32(0))) | (
        (c >> 3) << 31
    )
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_factor(scale: jax.Array) -> jax.Array:
    """E8M0 scales -> float32 powers of two (NaN for 255)."""
    e = scale.astype(jnp.int32)
    return jnp.where(e == SCALE_NAN, jnp.nan, jnp.ldexp(jnp.float32(1.0), e - SCALE_BIAS))


def _check_shapes(packed: jax.Array, scale: jax.Array) -> None:
    if packed.shape[:-1] != scale.shape[:-1] or 2 * packed.shape[-1] != GROUP * scale.shape[-1]:
        raise ValueError(f"MXFP4 packed shape {packed.shape} and scale shape {scale.shape} do not fit")


def dequantize(packed: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """[.., out, in/2] codes and [.., out, in/32] E8M0 scales -> [.., out, in] in `dtype` (traceable)."""
    _check_shapes(packed, scale)
    cols = 2 * packed.shape[-1]
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], cols)
    values = _e2m1(codes)
    out = values.reshape(*scale.shape, GROUP) * _scale_factor(scale)[..., None]
    return out.reshape(values.shape).astype(dtype)


def matvec(w: MXFP4, x: jax.Array) -> jax.Array:
    """`dequantize(w) @ x` for one packed matrix w [out, in] and one vector x [in]: [out] float32.

    The decode-sized product of the CPU expert loop. Written as elementwise work and sums (per 32 columns,
    then over the groups, times each group's power of two) so that XLA fuses the decoding into the
    reduction: the codes are read once and no dequantized [out, in] matrix is written or read again, which
    on a CPU costs more than the matrix-vector product itself. The reference is `dequantize(...) @ x`; the
    two differ only in the order of the float32 sums."""
    _check_shapes(w.packed, w.scale)
    if w.packed.ndim != 2 or x.shape != (w.shape[-1],):
        raise ValueError(f"matvec takes one matrix [out, in] and a vector [in]; got {w.shape} and {x.shape}")
    out, groups = w.scale.shape
    codes = w.packed.reshape(out, groups, GROUP // 2)
    xs = x.astype(jnp.float32).reshape(groups, GROUP // 2, 2)  # columns 2i (low nibble) and 2i + 1 (high)
    per_group = jnp.sum(_e2m1(codes & 0x0F) * xs[..., 0] + _e2m1(codes >> 4) * xs[..., 1], axis=-1)
    return jnp.sum(per_group * _scale_factor(w.scale), axis=-1)


def quantize(w: jax.Array) -> MXFP4:
    """[.., out, in] floats -> MXFP4 (traceable): the rule of `jaxhybrid.weights.mxfp4.quantize_mxfp4`
    (scale 2^(floor(log2(amax)) - 2) per 32 columns, round to the nearest E2M1 value, ties to the even
    code, saturating at 6), computed in float32. Used to initialise packed experts at random."""
    *lead, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP}, got shape {w.shape}")
    groups = w.astype(jnp.float32).reshape(*lead, cols // GROUP, GROUP)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    _, ex = jnp.frexp(amax)
    e = jnp.clip(jnp.where(amax > 0, ex - 3, 0) + SCALE_BIAS, 0, 254)
    x = groups / jnp.ldexp(jnp.float32(1.0), e - SCALE_BIAS)[..., None]
    grid = jnp.asarray(E2M1_VALUES[:8])
    mag = jnp.minimum(jnp.abs(x), 6.0)
    hi = jnp.clip(jnp.searchsorted(grid, mag, side="left"), 0, 7)
    lo = jnp.clip(hi - 1, 0, 7)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    code = jnp.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = (code | jnp.where(jnp.signbit(x), 8, 0)).astype(jnp.uint8).reshape(*lead, cols // 2, 2)
    return MXFP4((code[..., 0] | (code[..., 1] << 4)).astype(jnp.uint8), e.astype(jnp.uint8))


def as_dense(w: ExpertWeight, dtype: Any) -> jax.Array:
    """The dense weight: an MXFP4 or int8 one dequantized to `dtype` (XLA may fuse this into the matmul
    reading it); a dense array as it is."""
    if isinstance(w, Int8):
        return int8.dequantize(w, dtype)
    return dequantize(w.packed, w.scale, dtype) if isinstance(w, MXFP4) else w


def expert_slice(w: ExpertWeight, index: Any) -> ExpertWeight:
    """`w[index]` over the leading (expert / group) dims, for a dense array or both arrays of an MXFP4 or
    int8 weight; indices are in range."""
    if isinstance(w, Int8):
        return int8.select(w, index)
    if isinstance(w, MXFP4):
        return MXFP4(take_leading(w.packed, index), take_leading(w.scale, index))
    return take_leading(w, index)

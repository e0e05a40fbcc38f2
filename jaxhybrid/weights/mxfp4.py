"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`, group 32): the routed-expert format of Kimi K3.

A weight W [out, in] is stored as two uint8 tensors:
- `weight_packed` [out, in/2]: byte i of a row holds column 2i in its low nibble, 2i+1 in its high nibble.
  A nibble is E2M1 with bit 3 the sign: codes 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; 8..15 -> the negatives.
- `weight_scale` [out, in/32]: one E8M0 byte e per 32 columns, the power of two 2^(e - 127).

W[o, c] = E2M1(code[o, c]) * 2^(scale[o, c // 32] - 127). Every such product is a power of two times a
2-bit mantissa, so it is exact in float32 and bfloat16 wherever it is in their range: e = 0 (2^-127) gives
subnormals, which both types hold exactly; from 2 * 2^127 up (e = 254) the product overflows to inf.
E8M0 255 is NaN (OCP MX): its 32 weights dequantize to NaN here, and the checkpoint loader refuses a
checkpoint with such a scale rather than loading NaN weights.

All functions are pure; leading dimensions (e.g. stacked experts [E, out, in/2]) pass through. These NumPy
functions are the reference of the JAX ones in `jaxhybrid.ops.mxfp4` (serving with the experts kept packed),
which also holds the format's constants.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxhybrid.ops.mxfp4 import E2M1_VALUES, GROUP, SCALE_BIAS, SCALE_NAN

__all__ = ["E2M1_VALUES", "GROUP", "SCALE_BIAS", "SCALE_NAN", "dequantize_mxfp4", "quantize_mxfp4"]
_MAGNITUDES = E2M1_VALUES[:8].astype(np.float64)
BITS_PER_WEIGHT = 4 + 8 / GROUP  # 4.25: a nibble plus a 32nd of a scale byte


class MXFP4Error(ValueError):
    """Packed / scale tensors whose shapes do not fit together."""


def _check_shapes(packed_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int:
    """The logical column count `in` of a packed [.., out, in/2] / scale [.., out, in/32] pair."""
    if len(packed_shape) < 1 or packed_shape[:-1] != scale_shape[:-1]:
        raise MXFP4Error(
            f"packed shape {list(packed_shape)} and scale shape {list(scale_shape)} do not match"
        )
    cols = 2 * packed_shape[-1]
    if cols != GROUP * scale_shape[-1]:
        raise MXFP4Error(
            f"packed shape {list(packed_shape)} holds {cols} columns but scale shape {list(scale_shape)} "
            f"covers {GROUP * scale_shape[-1]}"
        )
    return cols


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight_packed shape, weight_scale shape) of a logical weight shape [.., out, in] (in % 32 == 0)."""
    *lead, cols = shape
    if cols % GROUP:
        raise MXFP4Error(
            f"MXFP4 needs the input dimension to be a multiple of {GROUP}, got shape {list(shape)}"
        )
    return (*lead, cols // 2), (*lead, cols // GROUP)


def mxfp4_nbytes(shape: tuple[int, ...]) -> int:
    """Storage bytes (packed + scales) of a weight of logical shape `shape`: 4.25 bits per weight."""
    p, s = packed_shapes(tuple(shape))
    return int(np.prod(p, dtype=np.int64)) + int(np.prod(s, dtype=np.int64))


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """[.., out, in/2] uint8 codes and [.., out, in/32] uint8 E8M0 scales -> [.., out, in] in `dtype`."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    packed, scale = np.asarray(packed), np.asarray(scale)
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise MXFP4Error(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    cols = _check_shapes(packed.shape, scale.shape)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], cols)
    values = E2M1_VALUES[codes]
    e = scale.astype(np.int32)
    with np.errstate(over="ignore"):  # 255 -> 2^128 overflows; it is NaN below, and big products are inf
        factor = np.ldexp(np.float32(1.0), e - SCALE_BIAS).astype(np.float32)
        factor = np.where(e == SCALE_NAN, np.float32(np.nan), factor)
        out = values.reshape(*scale.shape, GROUP) * factor[..., None]
    return out.reshape(values.shape).astype(dtype)


def _round_to_grid(x: np.ndarray) -> np.ndarray:
    """E2M1 codes nearest to x (float64, already divided by the scale): ties to the even code, |x| > 6
    saturates to +-6; the sign bit follows x's (so -0.0 is code 8)."""
    mag = np.minimum(np.abs(x), 6.0)
    hi = np.clip(np.searchsorted(_MAGNITUDES, mag, side="left"), 0, 7)  # first grid value >= mag
    lo = np.clip(hi - 1, 0, 7)
    d_lo, d_hi = mag - _MAGNITUDES[lo], _MAGNITUDES[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[.., out, in] floats -> (packed [.., out, in/2], scale [.., out, in/32]), both uint8.

    Per group of 32 the scale is 2^(floor(log2(amax)) - 2) (the OCP MX choice: amax lands in [4, 8)),
    values round to the nearest E2M1 value (ties to even, saturating at 6). A group whose values are all
    E2M1 values times one power of two in E8M0's range comes back exactly. An all-zero group gets e = 127.
    """
    w = np.asarray(w, dtype=np.float64)
    p_shape, s_shape = packed_shapes(w.shape)
    groups = w.reshape(*s_shape, GROUP)
    amax = np.max(np.abs(groups), axis=-1)
    if not np.all(np.isfinite(amax)):
        raise MXFP4Error("cannot quantize non-finite values to MXFP4")
    _, ex = np.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    exp = np.where(amax > 0, ex.astype(np.int64) - 1 - 2, 0)
    e = np.clip(exp + SCALE_BIAS, 0, 254)
    codes = _round_to_grid(groups / np.ldexp(1.0, e - SCALE_BIAS)[..., None]).reshape(w.shape)
    pairs = codes.reshape(*p_shape, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return packed, e.astype(np.uint8)

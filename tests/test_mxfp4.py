"""MXFP4 (K3's routed experts): every E2M1 code and several E8M0 exponents dequantize to the values K3.md
gives, nibble order on a hand-built byte, one scale per 32 columns, exactness in bfloat16, quantization
round trips, storage bytes. Expected values come from K3.md's table typed in here, never from the code."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.ops import mxfp4 as ops_mxfp4
from jaxhybrid.weights.mxfp4 import (
    MXFP4Error,
    dequantize_mxfp4,
    mxfp4_nbytes,
    quantize_mxfp4,
)

# K3.md: codes 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 -> the negatives.
K3_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def pack_row(codes: list[int]) -> list[int]:
    """Bytes of one row: column 2i in the low nibble, 2i+1 in the high nibble (K3.md)."""
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


def all_codes_row() -> np.ndarray:
    """One 32-column row: columns 0..15 hold codes 0..15, columns 16..31 code 0."""
    return np.array([pack_row(list(range(16)) + [0] * 16)], np.uint8)


@pytest.mark.parametrize("e", [127, 120, 134, 1, 0, 200])
def test_every_code_at_several_exponents(e):
    got = dequantize_mxfp4(all_codes_row(), np.array([[e]], np.uint8), np.float32)
    want = [v * 2.0 ** (e - 127) for v in K3_E2M1] + [0.0] * 16
    assert got.shape == (1, 32) and got.dtype == np.float32
    np.testing.assert_array_equal(got[0].astype(np.float64), want)
    assert np.signbit(got[0, 8]) and not np.signbit(got[0, 0])  # code 8 is -0.0


@pytest.mark.parametrize("e", [127, 120, 134, 0, 1, 250])
def test_exact_in_bfloat16(e):
    got = dequantize_mxfp4(all_codes_row(), np.array([[e]], np.uint8), jnp.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16
    want = [v * 2.0 ** (e - 127) for v in K3_E2M1] + [0.0] * 16
    np.testing.assert_array_equal(got[0].astype(np.float64), want)
    assert got[0, 1] != 0  # 0.5 * 2^-127 = 2^-128 is a (subnormal) nonzero bfloat16


def test_extreme_exponents():
    """e = 254: 1.5 * 2^127 is below float32's and bfloat16's maximum (about 2^128), 2 * 2^127 and above
    overflow to inf; e = 255 is E8M0 NaN: its whole group of 32 is NaN (the loader refuses it)."""
    for dtype in (np.float32, jnp.bfloat16):
        top = dequantize_mxfp4(all_codes_row(), np.array([[254]], np.uint8), dtype)[0].astype(np.float64)
        assert top[2] == 2.0**127 and top[3] == 1.5 * 2.0**127 and top[11] == -1.5 * 2.0**127
        assert np.isposinf(top[4:8]).all() and np.isneginf(top[12:16]).all()
    nan = dequantize_mxfp4(all_codes_row(), np.array([[255]], np.uint8), np.float32)[0]
    assert np.isnan(nan).all()


def test_nibble_order_of_a_hand_built_byte():
    # 0x2F: low nibble 0xF (code 15, -6.0) is column 0, high nibble 0x2 (code 2, 1.0) is column 1
    packed = np.full((1, 16), 0x2F, np.uint8)
    got = dequantize_mxfp4(packed, np.array([[127]], np.uint8))
    np.testing.assert_array_equal(got[0, :4], [-6.0, 1.0, -6.0, 1.0])
    got = dequantize_mxfp4(packed, np.array([[128]], np.uint8))
    np.testing.assert_array_equal(got[0, :2], [-12.0, 2.0])


def test_one_scale_per_32_columns_and_per_row():
    packed = np.full((2, 32), 0x22, np.uint8)  # every weight code 2 (1.0); 64 columns, 2 groups per row
    scale = np.array([[127, 130], [126, 120]], np.uint8)
    got = dequantize_mxfp4(packed, scale)
    assert got.shape == (2, 64)
    np.testing.assert_array_equal(got[0, :32], 1.0)
    np.testing.assert_array_equal(got[0, 32:], 8.0)
    np.testing.assert_array_equal(got[1, :32], 0.5)
    np.testing.assert_array_equal(got[1, 32:], 2.0**-7)


def random_representable(rng, shape, force_top: bool):
    """(W, codes, exponents): W[o, c] = K3_E2M1[code] * 2^(e - 127) built from the table here. With
    `force_top`, column 0 of each group has magnitude 4 or 6 (so the OCP scale choice is this e)."""
    out, cols = shape
    codes = rng.integers(0, 16, size=shape)
    exps = rng.integers(100, 150, size=(out, cols // 32))
    if force_top:
        codes[:, ::32] = rng.choice([6, 7, 14, 15], size=(out, cols // 32))
    table = np.array(K3_E2M1)
    w = table[codes] * np.exp2(np.repeat(exps, 32, axis=1) - 127.0)
    return w, codes, exps


def test_whole_matrix_round_trip():
    rng = np.random.default_rng(0)
    w, codes, exps = random_representable(rng, (48, 96), force_top=True)
    packed, scale = quantize_mxfp4(w.astype(np.float32))
    assert packed.shape == (48, 48) and scale.shape == (48, 3)
    assert packed.dtype == np.uint8 and scale.dtype == np.uint8
    # the bytes are exactly what K3.md's packing of these codes and exponents gives
    np.testing.assert_array_equal(packed, [pack_row(list(r)) for r in codes])
    np.testing.assert_array_equal(scale, exps)
    for dtype in (np.float32, jnp.bfloat16):
        np.testing.assert_array_equal(dequantize_mxfp4(packed, scale, dtype).astype(np.float64), w)
    # groups without a 4 or 6 get another scale, but still come back exactly
    w2, _, _ = random_representable(rng, (16, 64), force_top=False)
    np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(w2)).astype(np.float64), w2)


def test_quantize_rounds_to_nearest_even_and_saturates():
    row = np.zeros((1, 32))
    row[0, :8] = [7.0, 0.25, 0.75, 2.5, 5.0, -0.25, -1.25, 3.5]  # amax 7: scale 2^0 (7 in [4, 8))
    packed, scale = quantize_mxfp4(row)
    assert scale[0, 0] == 127
    # 7 saturates to 6; ties go to the even code: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4, -1.25 -> -1,
    # 3.5 -> 4 (code 6 over code 5)
    want = [6.0, 0.0, 1.0, 2.0, 4.0, -0.0, -1.0, 4.0]
    np.testing.assert_array_equal(dequantize_mxfp4(packed, scale)[0, :8], want)
    zero = quantize_mxfp4(np.zeros((2, 32)))
    assert (zero[0] == 0).all() and (zero[1] == 127).all()


def test_jax_matches_numpy_on_stacked_experts():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(3, 8, 32), dtype=np.uint8)
    scale = rng.integers(110, 140, size=(3, 8, 2), dtype=np.uint8)
    want = dequantize_mxfp4(packed, scale, np.float32)
    assert want.shape == (3, 8, 64)
    got = ops_mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)
    got16 = ops_mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16).astype(np.float32), want)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(1, 32), (3, 64), (2, 4, 96)]),
    log_scale=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_jax_quantize_matches_numpy(shape, log_scale, seed):
    """`ops.mxfp4.quantize` (random init of packed experts) gives the bytes of the NumPy reference,
    ties and saturation included (values drawn on and between the E2M1 grid, some exactly between)."""
    rng = np.random.default_rng(seed)
    halves = rng.integers(-14, 15, size=shape) / 2.0  # 0, +-0.5, ... +-7: grid points and midpoints
    w = (halves + rng.normal(0, 0.1, size=shape) * (rng.random(shape) < 0.5)) * 2.0**log_scale
    w = w.astype(np.float32)
    want_p, want_s = quantize_mxfp4(w)
    got = ops_mxfp4.quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(got.packed), want_p)
    np.testing.assert_array_equal(np.asarray(got.scale), want_s)
    assert got.shape == w.shape


def test_storage_bytes():
    # K3.md: w1 / w3 [3072, 3584], w2 [3584, 3072]: a nibble per weight plus a byte per 32
    assert mxfp4_nbytes((3072, 3584)) == 3072 * 3584 // 2 + 3072 * 3584 // 32
    assert mxfp4_nbytes((896, 3584, 3072)) * 8 == 896 * 3584 * 3072 * 4.25
    with pytest.raises(MXFP4Error, match="multiple of 32"):
        mxfp4_nbytes((8, 48))


def test_shape_and_dtype_errors():
    with pytest.raises(MXFP4Error, match="covers 64"):
        dequantize_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(MXFP4Error, match="do not match"):
        dequantize_mxfp4(np.zeros((2, 16), np.uint8), np.zeros((3, 1), np.uint8))
    with pytest.raises(MXFP4Error, match="uint8"):
        dequantize_mxfp4(np.zeros((2, 16), np.int32), np.zeros((2, 1), np.uint8))


@pytest.mark.parametrize("out, cols", [(1, 32), (8, 64), (24, 256)])
def test_matvec_equals_the_reference_dequantized_product(out, cols):
    """`ops.mxfp4.matvec` (decoding while it sums) equals the NumPy reference's dequantized matrix times the
    vector in float64, within fp32 summation error; an E8M0 NaN scale makes its row NaN, as dequantizing
    does."""
    rng = np.random.default_rng(out + cols)
    packed = rng.integers(0, 256, size=(out, cols // 2), dtype=np.uint8)
    scale = rng.integers(115, 135, size=(out, cols // 32), dtype=np.uint8)
    x = rng.standard_normal(cols).astype(np.float32)
    dense = dequantize_mxfp4(packed, scale, np.float64)
    want = dense @ x.astype(np.float64)
    # float32 sums of `cols` exact products: each row within cols * 2^-24 of the sum of their magnitudes
    bound = cols * 2.0**-24 * (np.abs(dense) @ np.abs(x.astype(np.float64)))
    w = ops_mxfp4.MXFP4(jnp.asarray(packed), jnp.asarray(scale))
    got = np.asarray(ops_mxfp4.matvec(w, jnp.asarray(x)))
    assert got.dtype == np.float32 and got.shape == (out,)
    assert (np.abs(got - want) <= bound).all()
    scale[0, -1] = 255
    nan_row = ops_mxfp4.MXFP4(jnp.asarray(packed), jnp.asarray(scale))
    got = np.asarray(ops_mxfp4.matvec(nan_row, jnp.asarray(x)))
    assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
    with pytest.raises(ValueError, match="one matrix"):
        ops_mxfp4.matvec(w, jnp.asarray(x[:-2]))

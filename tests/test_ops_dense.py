"""Float32 decode products (`jaxhybrid.ops.dense`) and the grouped projections (`matmul_many`, `project`):
the CPU kernel against a float64 NumPy product, the pairs against their reference, XLA's path when the
kernel is off, and which calls a decode-sized program makes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, float32_product_bound
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.layers.basic import Linear, project
from jaxhybrid.ops import dense, int8
from jaxhybrid.ops.native import f32_kernel, gemm_rows

TARGET = "jaxhybrid_matvec_f32"


def _f64(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def assert_float32_product(got, x, w, extra_roundings=0):
    """`got` is a float32 evaluation of x @ w.T: within gamma(K) of its terms' magnitudes (`bounds`)."""
    assert_within(got, _f64(x, w), float32_product_bound(x, w, extra_roundings))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, int8.KERNEL_ROWS + 3),
    out=st.sampled_from([1, 3, 64, 200, 768]),
    cols=st.sampled_from([8, 33, 64, 100, 256]),
    stack=st.sampled_from([(), (3,), (2, 3)]),
    seed=st.integers(0, 2**16),
)
def test_the_product_equals_a_float64_product(rows, out, cols, stack, seed):
    """Any width (a vector body and a scalar tail), a matrix of a stack read in place by its index; more
    rows than KERNEL_ROWS take XLA's product. fp32 sums: within gamma(K) of the terms' magnitudes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((*stack, out, cols)).astype(np.float32)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    index = tuple(int(rng.integers(0, n)) for n in stack) or None
    index = index[0] if index is not None and len(index) == 1 else index
    got = np.asarray(jax.jit(dense.matmul)(jnp.asarray(x), jnp.asarray(w), index))
    assert_float32_product(got, x, w if index is None else w[index])


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.integers(1, 90),
    out=st.sampled_from([1, 48, 200]),
    cols=st.sampled_from([16, 40, 96, 300]),
    experts=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_per_row_matrices_equal_a_float64_product(pairs, out, cols, experts, seed):
    """Row p against matrix ids[p], the rows of one matrix grouped whatever their order (a call of 24 rows or
    more, 8 per matrix, through the blocked product where it is built: a prompt's experts); id -1: zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((experts, out, cols)).astype(np.float32)
    x = rng.standard_normal((pairs, cols)).astype(np.float32)
    ids = rng.integers(-1, experts, pairs)
    got = np.asarray(jax.jit(dense.matmul_pairs)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids, jnp.int32)))
    for p in np.flatnonzero(ids >= 0):
        assert_float32_product(got[p : p + 1], x[p : p + 1], w[ids[p]])
    assert not got[ids < 0].any()


@pytest.mark.skipif(not gemm_rows(), reason="no AVX-512 here: no blocked product")
@pytest.mark.parametrize(("pairs", "experts", "out", "cols"), [(60, 2, 37, 300), (1100, 1, 40, 520)])
def test_the_blocked_product_of_many_rows_per_matrix_equals_a_float64_product(pairs, experts, out, cols):
    """Float32 experts of a prompt (about 20 rows each, or about 550 of one: tiles of 32 and a last one of up
    to 16, rows in chunks of 256 and jobs of 512, outputs in panels of 12, columns in blocks of 256 and a
    scalar tail), read in place, against float64 one matrix at a time, within gamma(K)."""
    rng = np.random.default_rng(pairs)
    w = rng.standard_normal((experts, out, cols)).astype(np.float32)
    x = rng.standard_normal((pairs, cols)).astype(np.float32)
    ids = rng.integers(-1, experts, pairs)
    got = np.asarray(jax.jit(dense.matmul_pairs)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids, jnp.int32)))
    for e in range(experts):
        assert_float32_product(got[ids == e], x[ids == e], w[e])
    assert not got[ids < 0].any()


@pytest.mark.parametrize("rows", [1, 5, int8.KERNEL_ROWS + 1])
def test_several_projections_of_one_input(rows):
    """`matmul_many` (float32 and int8): each result that of its own matrix, whatever the matrices' sizes
    (one of a single output), and one kernel call for all of them at decode sizes."""
    rng = np.random.default_rng(rows)
    ws = [rng.standard_normal((n, 72)).astype(np.float32) for n in (96, 1, 130, 8)]
    x = rng.standard_normal((rows, 72)).astype(np.float32)
    got = jax.jit(dense.matmul_many)(jnp.asarray(x), [jnp.asarray(w) for w in ws])
    for y, w in zip(got, ws, strict=True):
        assert_float32_product(y, x, w)
    q = [int8.quantize(jnp.asarray(w)) for w in ws]
    got8 = jax.jit(int8.matmul_many)(jnp.asarray(x), q)
    for y, w in zip(
        got8, q, strict=True
    ):  # the scale may be applied per term or to the sum: one rounding more
        assert_float32_product(y, x, int8.dequantize(w), extra_roundings=2)
    if f32_kernel() is not None:
        text = jax.jit(dense.matmul_many).lower(jnp.asarray(x), [jnp.asarray(w) for w in ws]).as_text()
        assert text.count(TARGET) == (1 if rows <= int8.KERNEL_ROWS else 0)


def test_project_mixes_int8_and_float_layers():
    """`project` of layers some int8, some float: each layer's own result (one product each)."""
    rngs = nnx.Rngs(0)
    layers = [Linear(48, n, rngs=rngs) for n in (32, 16, 8)]
    layers[1].to_int8()
    x = jax.random.normal(jax.random.key(1), (2, 1, 48), jnp.float32)
    for got, layer in zip(project(x, *layers), layers, strict=True):
        assert_float32_product(
            np.asarray(got)[:, 0], x[:, 0], layer.dense_weight(jnp.float32), extra_roundings=2
        )


def test_without_the_kernel_every_product_takes_xla(monkeypatch):
    """No compiler (or JAXHYBRID_NATIVE=0): no custom call, the same numbers."""
    import jaxhybrid.ops.native as native

    monkeypatch.setattr(native, "f32_kernel", lambda: None)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 256, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
    assert TARGET not in jax.jit(dense.matmul).lower(x, w, 1).as_text()
    assert_float32_product(dense.matmul(x, w, 1), x, w[1])
    ys = dense.matmul_many(x, [w[0], w[2]])
    assert_float32_product(ys[1], x, w[2])


@pytest.mark.skipif(f32_kernel() is None, reason="no C++ compiler or no AVX2 here")
def test_only_float32_decode_sized_products_call_the_kernel():
    w = jnp.ones((64, 64), jnp.float32)
    lowered = jax.jit(dense.matmul).lower
    text = {
        "one row": lowered(jnp.ones((1, 64), jnp.float32), w).as_text(),
        "prefill": lowered(jnp.ones((int8.KERNEL_ROWS + 1, 64), jnp.float32), w).as_text(),
        "bf16": lowered(jnp.ones((1, 64), jnp.bfloat16), w.astype(jnp.bfloat16)).as_text(),
    }
    assert TARGET in text["one row"] and TARGET not in text["prefill"] and TARGET not in text["bf16"]

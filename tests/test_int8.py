"""Weight-only int8 (`jaxhybrid.ops.int8`, `HybridLM.to_int8`, `--weight-dtype int8`): the codes against a
NumPy computation, the CPU kernel and the blocked product against the dequantize-then-multiply reference, a
quantized model against its dequantized twin, and what the engine serves from it against its full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, float32_network_bound, float32_product_bound, gamma
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.config import load_config
from jaxhybrid.layers.basic import Linear
from jaxhybrid.layers.moe import Experts
from jaxhybrid.model import HybridLM, held_bytes
from jaxhybrid.ops import int8
from jaxhybrid.ops.moe import moe_experts_dense, moe_experts_dropless
from jaxhybrid.ops.native import gemm_rows, int8_kernel
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams


def test_quantize_is_symmetric_per_output_channel():
    """Oracle: the rule computed in float64 NumPy (scale max|row| / 127; an all-zero row gets scale 1)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 7, 40)).astype(np.float32)
    w[1, 3] = 0.0
    got = int8.quantize(jnp.asarray(w))
    amax = np.abs(w.astype(np.float64)).max(-1)
    scale = np.where(amax > 0, amax / 127, 1.0)
    # max|row| is exact; / 127 (or * 1/127) rounds once or twice: within gamma(2) of the float64 rule
    np.testing.assert_allclose(np.asarray(got.scale), scale, rtol=gamma(2), atol=0)
    codes = np.clip(np.rint(w / np.asarray(got.scale)[..., None]), -127, 127)
    np.testing.assert_array_equal(np.asarray(got.q), codes.astype(np.int8))
    assert got.q.dtype == jnp.int8 and np.abs(np.asarray(got.q)).max() == 127
    # dequantized within half a step of the original, plus float32's roundings: w / scale (which may move a
    # code across a half step by u |w| / scale, so u |w| after scaling back) and q * scale (u |q scale|)
    err = np.abs(np.asarray(int8.dequantize(got), np.float64) - w)
    step = np.asarray(got.scale, np.float64)[..., None]
    assert np.all(err <= step / 2 + gamma(3) * (np.abs(w) + step))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 80),
    out=st.sampled_from([1, 3, 64, 200, 768]),
    cols=st.sampled_from([8, 33, 64, 100, 256, 300]),
    stack=st.sampled_from([(), (3,), (2, 3)]),
    seed=st.integers(0, 2**16),
)
def test_the_fast_product_equals_the_reference(rows, out, cols, stack, seed):
    """Rows up to KERNEL_ROWS take the CPU kernel's matrix-vector body (any width: a vector body and a scalar
    tail), from 24 its blocked matrix product (with AVX-512; tiles of 32 rows, a last one of up to 16,
    columns in blocks of 256), between them the matrix-vector body again, or without the blocked product
    XLA's; matrix `index` of a stack is read in place. Both float32: within twice gamma(K) (`bounds`)."""
    rng = np.random.default_rng(seed)
    w = int8.quantize(jnp.asarray(rng.standard_normal((*stack, out, cols)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)
    index = tuple(int(rng.integers(0, n)) for n in stack) or None
    index = index[0] if index is not None and len(index) == 1 else index
    want = np.asarray(jax.jit(int8.matmul_reference)(x, w, index))
    got = np.asarray(jax.jit(int8.matmul)(x, w, index))
    m = int8.dequantize(w if index is None else int8.select(w, index))
    assert_within(got, want, 2 * float32_product_bound(x, m, extra_roundings=2))  # both sides may err


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.integers(1, 70),
    out=st.sampled_from([1, 48, 200]),
    cols=st.sampled_from([16, 40, 96, 300]),
    experts=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_per_row_matrices_equal_the_reference(pairs, out, cols, experts, seed):
    """Row p against matrix ids[p] (one kernel call for every pair of a step, the rows of one matrix grouped
    whatever their order; a call of 24 rows or more, 8 per matrix, through the blocked product where it is
    built); id -1: a row of zeros."""
    rng = np.random.default_rng(seed)
    w = int8.quantize(jnp.asarray(rng.standard_normal((experts, out, cols)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((pairs, cols)), jnp.float32)
    ids = jnp.asarray(rng.integers(-1, experts, pairs), jnp.int32)
    want = np.asarray(jax.jit(int8.matmul_pairs_reference)(x, w, ids))
    got = np.asarray(jax.jit(int8.matmul_pairs)(x, w, ids))
    dense = np.asarray(int8.dequantize(w))
    for p in np.flatnonzero(np.asarray(ids) >= 0):
        bound = 2 * float32_product_bound(x[p : p + 1], dense[int(ids[p])], extra_roundings=2)
        assert_within(got[p : p + 1], want[p : p + 1], bound)
    assert not got[np.asarray(ids) < 0].any()


@pytest.mark.parametrize(("tokens", "blocked"), [(1, True), (5, True), (40, True), (200, True), (200, False)])
def test_int8_experts_equal_the_dense_reference_on_their_dequantized_weights(monkeypatch, tokens, blocked):
    """Decode-sized batches take the loop-free pairs path; larger ones too where the kernel has its blocked
    product (each expert's rows one group), else (`blocked` False, or no AVX-512) the expert loop (blocks of
    up to 16 rows through the kernel; 200 tokens: blocks of 64 rows, each expert dequantized once for all of
    its blocks); all against every expert on every token (`moe_experts_dense`) with the dequantized weights;
    rows not valid give zeros."""
    import jaxhybrid.ops.native as native

    if not blocked:
        monkeypatch.setattr(native, "gemm_rows", lambda: 0)
    rng = np.random.default_rng(tokens)
    E, D, F, k = 6, 32, 48, 2
    w1, w3 = (int8.quantize(jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)) for _ in range(2))
    w2 = int8.quantize(jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    valid = jnp.asarray(rng.random(tokens) < 0.8)
    got = moe_experts_dropless(x, w1, w2, w3, weights, ids, valid=valid)
    dense = [int8.dequantize(w) for w in (w1, w2, w3)]
    want = moe_experts_dense(x, *dense, weights, ids, valid=valid)
    # two chained products (gate/up over D, down over F) summed in other orders by the kernel and by XLA:
    # each sum of K products rounds within K u of its terms' magnitudes, either side may err (2 x), and the
    # second product carries the first's error: 2 * 2 * max(D, F) * u of the largest output (1.1e-5)
    bound = 2 * 2 * max(D, F) * 2.0**-24
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=bound * np.abs(want).max())
    assert not np.asarray(got)[~np.asarray(valid)].any()


@pytest.mark.parametrize("rows", [1, 3, 12])
def test_without_the_kernel_every_product_takes_xla(monkeypatch, rows):
    """No compiler (or JAXHYBRID_NATIVE=0): the same numbers through XLA's blocked product and the pairs
    reference."""
    import jaxhybrid.ops.native as native

    monkeypatch.setattr(native, "int8_kernel", lambda: None)
    rng = np.random.default_rng(rows)
    w = int8.quantize(jnp.asarray(rng.standard_normal((3, 2048, 64)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    text = jax.jit(int8.matmul).lower(x, w, 1).as_text()
    assert "jaxhybrid_matvec_int8" not in text
    want = np.asarray(int8.matmul_reference(x, w, 1))
    bound = 2 * float32_product_bound(x, int8.dequantize(int8.select(w, 1)), extra_roundings=2)
    assert_within(int8.matmul(x, w, 1), want, bound)
    ids = jnp.asarray(rng.integers(-1, 3, rows), jnp.int32)
    pairs = np.asarray(int8.matmul_pairs(x, w, ids))
    want = np.asarray(int8.matmul_pairs_reference(x, w, ids))
    dense = np.asarray(int8.dequantize(w))
    for p in np.flatnonzero(np.asarray(ids) >= 0):
        bound = 2 * float32_product_bound(x[p : p + 1], dense[int(ids[p])], extra_roundings=2)
        assert_within(pairs[p : p + 1], want[p : p + 1], bound)
    assert not pairs[np.asarray(ids) < 0].any()


@pytest.mark.skipif(int8_kernel() is None, reason="no C++ compiler or no AVX2 here")
def test_decode_sized_products_call_the_kernel(monkeypatch):
    """A decode-sized batch always takes the kernel; a prompt's rows take it where it has its blocked
    product, else XLA's blocked dequantize-then-multiply."""
    import jaxhybrid.ops.native as native

    w = int8.quantize(jnp.ones((64, 64), jnp.float32))

    def lowered(rows: int) -> str:  # a new function each time: no trace cached before the patch below
        return jax.jit(lambda x, w: int8.matmul(x, w)).lower(jnp.ones((rows, 64), jnp.float32), w).as_text()

    assert "jaxhybrid_matvec_int8" in lowered(1)
    assert ("jaxhybrid_matvec_int8" in lowered(int8.KERNEL_ROWS + 1)) == (native.gemm_rows() > 0)
    monkeypatch.setattr(native, "gemm_rows", lambda: 0)
    assert "jaxhybrid_matvec_int8" in lowered(1)
    assert "jaxhybrid_matvec_int8" not in lowered(int8.KERNEL_ROWS + 1)


@pytest.mark.skipif(not gemm_rows(), reason="no AVX-512 here: no blocked int8 product")
@pytest.mark.parametrize(
    ("rows", "out", "cols"), [(24, 37, 300), (47, 12, 16), (300, 100, 1000), (30, 1300, 40)]
)
def test_the_blocked_product_equals_a_float64_product(rows, out, cols):
    """The kernel's blocked product (24 rows and more: one tile of 24, a tile of 32 and one of 15, 300 rows
    over two chunks of 256; outputs not a multiple of the 12-row panel, 1300 of them: each thread's share
    in two chunks of 288; 1000 columns: four blocks, a scalar tail of 8) against the product of the
    dequantized weights in float64 NumPy: within gamma(K) of the terms' magnitudes (`bounds`)."""
    rng = np.random.default_rng(rows)
    w = int8.quantize(jnp.asarray(rng.standard_normal((out, cols)), jnp.float32))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    got = np.asarray(jax.jit(int8.matmul)(jnp.asarray(x), w))
    dense = np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64)[:, None]
    want = x.astype(np.float64) @ dense.T
    assert_within(got, want, float32_product_bound(x, dense, extra_roundings=2))
    assert "jaxhybrid_matvec_int8" in jax.jit(int8.matmul).lower(jnp.asarray(x), w).as_text()


@pytest.mark.skipif(int8_kernel() is None, reason="no C++ compiler or no AVX2 here")
@pytest.mark.parametrize("pairs", [30, 300])
def test_a_rows_product_does_not_depend_on_the_other_rows(pairs):
    """Which products a row takes is fixed by the call's shape, never by how the other rows are routed: rows
    0-19 against matrix 0 give the same bits whether the rest go to matrix 1 or join them (a group then
    past 24 rows). Else a later token's routing would move an earlier token's logits (causality, bit for
    bit, as tests/test_model.py checks)."""
    rng = np.random.default_rng(pairs)
    w = int8.quantize(jnp.asarray(rng.standard_normal((2, 48, 300)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((pairs, 300)), jnp.float32)
    apart = jnp.asarray([0] * 20 + [1] * (pairs - 20), jnp.int32)
    joined = jnp.zeros((pairs,), jnp.int32)
    a = np.asarray(jax.jit(int8.matmul_pairs)(x, w, apart))
    b = np.asarray(jax.jit(int8.matmul_pairs)(x, w, joined))
    np.testing.assert_array_equal(a[:20], b[:20])


@pytest.fixture(scope="module")
def tiny_int8():
    model = HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)
    model.to_int8()
    return model


def _twin(model: HybridLM) -> HybridLM:
    """The same config in float32 with every int8 weight replaced by its dequantized value."""
    twin = HybridLM(model.config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    pairs = zip(
        (m for _, m in nnx.iter_graph(twin) if isinstance(m, Linear | Experts)),
        (m for _, m in nnx.iter_graph(model) if isinstance(m, Linear | Experts)),
        strict=True,
    )
    for dense, q in pairs:
        names = ("weight",) if isinstance(q, Linear) else ("w1", "w2", "w3")
        for n in names:
            getattr(dense, n)[...] = int8.dequantize(
                int8.Int8(getattr(q, n)[...], getattr(q, f"{n}_scale")[...])
            )
    return twin


def test_an_int8_model_computes_what_its_dequantized_twin_does(tiny_int8):
    """Logits of the int8 model against the float32 model holding its dequantized weights, within the float32
    rounding bound of two summation orders (`bounds.float32_network_bound`, 6.1e-4 for tiny;
    a wrong scale or code is off by percents)."""
    toks = jnp.asarray(np.random.default_rng(1).integers(3, 512, (2, 40)), jnp.int32)
    got, want = np.asarray(tiny_int8(toks)), np.asarray(_twin(tiny_int8)(toks))
    bound = float32_network_bound(tiny_int8.config, toks.shape[1])
    np.testing.assert_allclose(got, want, rtol=0, atol=bound * np.abs(want).max())


def test_int8_bytes_are_one_per_weight_and_four_per_channel(tiny_int8):
    """Hand count: every Linear and dense expert stack holds 1 byte per weight + a float32 per output
    channel; everything else is as the float32 model holds it."""
    dense = HybridLM(tiny_int8.config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    saved = 0
    for _, m in nnx.iter_graph(dense):
        if isinstance(m, Linear | Experts):
            for w in (m.weight,) if isinstance(m, Linear) else (m.w1, m.w2, m.w3):
                saved += w[...].size * 4 - (w[...].size + 4 * w[...].size // w[...].shape[-1])
    assert held_bytes(tiny_int8) == held_bytes(dense) - saved


def test_the_engine_serves_an_int8_model_as_its_full_pass(tiny_int8):
    """Decode rows go through the kernel, prefill chunks through the blocked product, the full pass through
    the blocked product: greedy tokens and logprobs agree (tests/oracles.py's tolerance)."""
    full = FullPass(tiny_int8)
    eng = Engine(tiny_int8, EngineConfig(max_slots=3, block_size=8, prefill_chunk=16))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, n).tolist() for n in (3, 21, 40)]
    results = eng.generate(prompts, greedy)
    for p, res in zip(prompts, results, strict=True):
        assert_matches_full_pass(full, p, res.token_ids, res.logprobs)

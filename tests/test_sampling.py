"""serve.engine.sampling: greedy/top-k/top-p correctness, empirical frequencies, keys, validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, float32_log_softmax_bound

from serve.engine.sampling import (
    SamplingError,
    SamplingParams,
    _argmax,
    batch_arrays,
    greedy,
    request_key,
    sample,
)

_jsample = jax.jit(sample)
# Frequency tolerance: 4000 draws give a per-id standard error of at most sqrt(0.25 / 4000) ~ 0.008, so 0.03
# is ~4 sigma; the keys are fixed, so the test is deterministic either way.
_N_DRAWS = 4000
_FREQ_TOL = 0.03


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _keys(seeds, steps) -> jax.Array:
    return jax.vmap(request_key)(jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.uint32))


def _draws(row, temperature=1.0, top_k=0, top_p=1.0, n=_N_DRAWS, seed=0) -> np.ndarray:
    """n draws for one logits row, each with its own key (seed, step i), in a single batched call."""
    logits = jnp.broadcast_to(jnp.asarray(row, jnp.float32), (n, len(row)))
    tok, _ = _jsample(
        logits,
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        _keys(np.full(n, seed), np.arange(n)),
    )
    return np.asarray(tok)


def _greedy_args(b: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return (
        jnp.zeros((b,), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), jnp.float32),
        _keys(np.zeros(b), np.arange(b)),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_is_argmax_with_exact_logprob(dtype) -> None:
    logits = jax.random.normal(jax.random.key(1), (8, 37), jnp.float32).astype(dtype)
    logits = logits.at[3, 5].set(9.0).at[3, 20].set(9.0)  # tie: lowest id wins
    tok, lp = _jsample(logits, *_greedy_args(8))
    ref = np.asarray(logits.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(tok), ref.argmax(-1))
    assert int(tok[3]) == 5
    assert tok.dtype == jnp.int32 and lp.dtype == jnp.float32
    picked = (np.arange(8), ref.argmax(-1))
    oracle = _np_log_softmax(ref)[picked]
    assert_within(lp, oracle, float32_log_softmax_bound(ref)[picked])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_equals_sampling_at_temperature_zero(dtype) -> None:
    """The model programs' `greedy` gives `sample`'s greedy tokens, and logprobs within two float32
    log-softmaxes' bound (one id's share of the same arithmetic, which XLA may fuse and order otherwise)."""
    logits = (jax.random.normal(jax.random.key(2), (6, 32000), jnp.float32) * 4).astype(dtype)
    logits = logits.at[1, 7].set(30.0).at[1, 31999].set(30.0)  # a tie: the lowest id
    tok, lp = greedy(logits)
    want_tok, want_lp = _jsample(logits, *_greedy_args(6))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    assert int(tok[1]) == 7 and tok.dtype == jnp.int32 and lp.dtype == jnp.float32
    ref = np.asarray(logits.astype(jnp.float32))
    bound = float32_log_softmax_bound(ref, sides=2)[np.arange(6), np.asarray(want_tok)]
    assert_within(lp, want_lp, bound)


def test_argmax_is_numpys_on_ties_infinities_and_nans() -> None:
    """Oracle: numpy's argmax (the first maximum; the first NaN where there is one)."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (200, 50)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, 10] = np.inf
    x[7, [3, 9]] = np.nan
    x[8] = np.nan
    x[9, 49] = np.nan
    np.testing.assert_array_equal(np.asarray(jax.jit(_argmax)(jnp.asarray(x))), x.argmax(-1))


def test_top_k_one_equals_greedy_and_tiny_temperature_is_finite() -> None:
    logits = jax.random.normal(jax.random.key(2), (16, 50), jnp.float32) * 3
    greedy, _ = _jsample(logits, *_greedy_args(16))
    keys = _keys(np.arange(16), np.zeros(16))
    tok, _ = _jsample(logits, jnp.full((16,), 1.3), jnp.ones((16,), jnp.int32), jnp.ones((16,)), keys)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy))
    tok, lp = _jsample(logits, jnp.full((16,), 1e-7), jnp.zeros((16,), jnp.int32), jnp.ones((16,)), keys)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(greedy))
    assert np.all(np.isfinite(np.asarray(lp)))


def test_top_k_never_leaves_the_top_k() -> None:
    row = np.asarray(jax.random.normal(jax.random.key(3), (16,))) * 0.3  # near-flat so all k ids show up
    k = 3
    top = set(np.argsort(-row)[:k].tolist())
    got = set(_draws(row, top_k=k, n=500).tolist())
    assert got == top


@pytest.mark.parametrize(
    "top_p, allowed", [(0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3}), (0.01, {0})]
)
def test_top_p_nucleus_sets(top_p: float, allowed: set[int]) -> None:
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(row, top_p=top_p).tolist()) == allowed


def test_top_k_then_top_p_renormalises() -> None:
    # After top_k=2 the survivors are [0.625, 0.375]; 0.625 >= 0.6 already, so only id 0 remains.
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(row, top_k=2, top_p=0.6, n=500).tolist()) == {0}
    assert set(_draws(row, top_p=0.6, n=500).tolist()) == {0, 1}


def test_frequencies_match_softmax_and_temperature_sharpens() -> None:
    row = np.array([1.0, 0.5, 0.0, -1.0])
    probs = np.exp(_np_log_softmax(row))
    freq1 = np.bincount(_draws(row, temperature=1.0, seed=7), minlength=4) / _N_DRAWS
    np.testing.assert_allclose(freq1, probs, atol=_FREQ_TOL)
    freq_half = np.bincount(_draws(row, temperature=0.5, seed=8), minlength=4) / _N_DRAWS
    np.testing.assert_allclose(freq_half, np.exp(_np_log_softmax(row / 0.5)), atol=_FREQ_TOL)
    assert freq_half[0] > freq1[0] + 0.1


def test_same_key_same_token_and_seeds_differ() -> None:
    b, v = 32, 1000
    logits = jnp.zeros((b, v), jnp.float32)  # flat: collisions between seeds have probability 1e-3 per row
    ones, no_k = jnp.ones((b,), jnp.float32), jnp.zeros((b,), jnp.int32)
    keys_a = _keys(np.arange(b), np.full(b, 4))
    tok_a, lp = _jsample(logits, ones, no_k, ones, keys_a)
    tok_a2, _ = _jsample(logits, ones, no_k, ones, _keys(np.arange(b), np.full(b, 4)))
    tok_b, _ = _jsample(logits, ones, no_k, ones, _keys(np.arange(b) + 1000, np.full(b, 4)))
    np.testing.assert_array_equal(np.asarray(tok_a), np.asarray(tok_a2))
    assert np.sum(np.asarray(tok_a) != np.asarray(tok_b)) > b // 2
    assert_within(lp, np.full(b, -math.log(v)), float32_log_softmax_bound(np.zeros((b, v)))[:, 0])


def test_row_independent_of_batch_composition() -> None:
    v = 1000
    row = jax.random.normal(jax.random.key(5), (v,))
    others = jax.random.normal(jax.random.key(6), (5, v))
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9), SamplingParams(), None, SamplingParams()]
    # Batch 1: target row first; batch 2: target row last among different neighbours and settings.
    t1, k1, p1, keys1 = batch_arrays([params[0], params[1], None], [11, 3, 0], [2, 0, 0])
    t2, k2, p2, keys2 = batch_arrays([params[3], None, params[1], params[0]], [99, 1, 5, 11], [7, 1, 1, 2])
    tok1, lp1 = _jsample(jnp.stack([row, others[0], others[1]]), t1, k1, p1, keys1)
    tok2, lp2 = _jsample(jnp.stack([others[2], others[3], others[4], row]), t2, k2, p2, keys2)
    assert int(tok1[0]) == int(tok2[3])
    assert float(lp1[0]) == float(lp2[3])


def test_batch_arrays_defaults_and_keys() -> None:
    t, k, p, keys = batch_arrays(
        [None, SamplingParams(temperature=0.7, top_k=5, top_p=0.5, seed=3)], [8, 3], [0, 9]
    )
    np.testing.assert_array_equal(np.asarray(t), np.array([0.0, 0.7], np.float32))
    np.testing.assert_array_equal(np.asarray(k), [0, 5])
    np.testing.assert_array_equal(np.asarray(p), np.array([1.0, 0.5], np.float32))
    assert keys.shape == (2,)
    expect = jax.random.key_data(request_key(3, 9))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys[1])), np.asarray(expect))
    big = jax.random.key_data(batch_arrays([None], [2**32 - 1], [0])[3][0])
    np.testing.assert_array_equal(np.asarray(big), np.asarray(jax.random.key_data(request_key(2**32 - 1, 0))))
    with pytest.raises(ValueError):
        batch_arrays([None, None], [0], [0, 0])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 101}, "top_k"),
        ({"stop_token_ids": (3, 100)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validate_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_validate_accepts_good_params() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=100, top_p=1.0, seed=0, stop_token_ids=(0, 99)).validate(
        vocab_size=100
    )
    assert issubclass(SamplingError, ValueError)


def test_jit_mixed_batch() -> None:
    v = 64
    logits = (jax.random.normal(jax.random.key(9), (6, v)) * 2).astype(jnp.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=4),
        SamplingParams(temperature=1.2, top_p=0.5),
        None,
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9),
        SamplingParams(temperature=1.0),
    ]
    tok, lp = _jsample(logits, *batch_arrays(params, list(range(6)), [3] * 6))
    tok = np.asarray(tok)
    ref = np.asarray(logits.astype(jnp.float32))
    order = np.argsort(-ref, axis=-1, kind="stable")
    assert tok[0] == ref[0].argmax() and tok[3] == ref[3].argmax()
    assert tok[1] in order[1, :4] and tok[4] in order[4, :10]
    assert np.all((tok >= 0) & (tok < v))
    oracle = _np_log_softmax(ref)[np.arange(6), tok]
    assert_within(lp, oracle, float32_log_softmax_bound(ref)[np.arange(6), tok])  # the untempered logprob

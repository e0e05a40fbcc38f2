"""Tests for jaxhybrid.ops.mla: expanded vs absorbed attention, a float64 oracle, and causal_mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_sums_bound, gamma

from jaxhybrid.ops import int8
from jaxhybrid.ops.mla import (
    PAGED_KERNEL_MAX_TOKENS,
    causal_mask,
    mla_attention_absorbed,
    mla_attention_causal_blocks,
    mla_attention_expanded,
    mla_attention_paged,
    mla_attention_paged_reference,
)
from jaxhybrid.ops.native import mla_decode_kernel

_H, _NOPE, _ROPE, _V, _R = 4, 16, 8, 12, 32
_SCALE = (_NOPE + _ROPE) ** -0.5


def _rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def mla_tol(q, latent, kv_b, ref, sides: int = 1, extra: int = 0) -> float:
    """Relative bound (max|a - b| / max|ref|) of float32 MLA, either form, against the float64 oracle (sides
    1) or the other form (2). A score sums _NOPE + _ROPE terms, the nope part through the latent's _R
    (absorbed or expanded: at most _R + _NOPE + _ROPE terms chained), and its absolute error is its softmax
    weight's relative error, twice after the normalization: 2 gamma(_R + _NOPE + _ROPE) times the scores'
    terms' magnitudes |q| . (|c| |W_uk|, |k_rope|), computed here from the inputs. Then the softmax's own
    roundings and sums over the S keys, the weighted sum over them and the value projection over _R: all
    relative to the values' terms' magnitudes |c| |W_uv|. `extra` roundings of each weight (int8 codes
    times their scale)."""
    q, latent, kv_b = (np.abs(np.asarray(a, np.float64)) for a in (q, latent, kv_b))
    c, k_r = latent[..., :_R], latent[..., _R:]
    heads = kv_b.reshape(_H, _NOPE + _V, _R)
    keys = np.concatenate(
        [
            np.einsum("bsr,hnr->bhsn", c, heads[:, :_NOPE]),
            np.broadcast_to(k_r[:, None], (c.shape[0], _H, c.shape[1], _ROPE)),
        ],
        -1,
    )
    scores = float(np.einsum("bthd,bhsd->bths", q, keys).max()) * _SCALE
    values = float(np.einsum("bsr,hvr->bhsv", c, heads[:, _NOPE:]).max())
    steps = latent.shape[1]
    k = _R + _NOPE + _ROPE + extra
    rel = 2 * gamma(k) * scores + float32_sums_bound(ACTIVATION_ROUNDINGS, steps, steps, _R + extra)
    return sides * rel * values / float(np.abs(np.asarray(ref)).max())


def _oracle(q, latent, kv_b, mask) -> np.ndarray:
    """Float64 per-(batch, head) attention with explicitly built K and V; empty rows give zeros."""
    q, latent, kv_b = (np.asarray(a, np.float64) for a in (q, latent, kv_b))
    mask = np.asarray(mask)
    batch, steps = q.shape[:2]
    c, k_r = latent[..., :_R], latent[..., _R:]
    out = np.zeros((batch, steps, _H, _V))
    for h in range(_H):
        rows = kv_b[h * (_NOPE + _V) : (h + 1) * (_NOPE + _V)]
        w_uk, w_uv = rows[:_NOPE], rows[_NOPE:]
        for b in range(batch):
            keys = np.concatenate([c[b] @ w_uk.T, k_r[b]], axis=-1)  # [S, nope + rope]
            values = c[b] @ w_uv.T  # [S, v]
            for t in range(steps):
                visible = mask[b, t]
                if not visible.any():
                    continue
                s = keys[visible] @ q[b, t, h] * _SCALE
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ values[visible]
    return out


def _inputs(rng: np.random.Generator, batch: int, steps: int, kv_len: int):
    q = rng.standard_normal((batch, steps, _H, _NOPE + _ROPE)).astype(np.float32)
    latent = rng.standard_normal((batch, kv_len, _R + _ROPE)).astype(np.float32)
    kv_b = (rng.standard_normal((_H * (_NOPE + _V), _R)) / np.sqrt(_R)).astype(np.float32)
    return q, latent, kv_b


def _run(fn, q, latent, kv_b, mask) -> jax.Array:
    call = jax.jit(lambda *a: fn(*a, nope_dim=_NOPE, v_dim=_V, scale=_SCALE))
    return call(jnp.asarray(q), jnp.asarray(latent), jnp.asarray(kv_b), jnp.asarray(mask))


@pytest.mark.parametrize(
    ("steps", "start", "valid"),
    [
        (1, [0, 7, 19], None),  # decode, ragged cache lengths
        (6, [0, 5, 11], None),  # prefill appended to ragged caches
        (6, [2, 0, 9], [6, 3, 1]),  # padded prefill
    ],
    ids=["decode", "prefill", "padded_prefill"],
)
def test_expanded_absorbed_oracle_agree(steps: int, start: list[int], valid: list[int] | None) -> None:
    rng = np.random.default_rng(steps)
    batch, kv_len = 3, 20
    q, latent, kv_b = _inputs(rng, batch, steps, kv_len)
    mask = causal_mask(
        jnp.asarray(start, jnp.int32), steps, kv_len, None if valid is None else jnp.asarray(valid, jnp.int32)
    )
    expanded = _run(mla_attention_expanded, q, latent, kv_b, mask)
    absorbed = _run(mla_attention_absorbed, q, latent, kv_b, mask)
    ref = _oracle(q, latent, kv_b, mask)
    assert expanded.shape == (batch, steps, _H, _V) and expanded.dtype == jnp.float32
    assert _rel_err(absorbed, expanded) < mla_tol(q, latent, kv_b, ref, sides=2)
    assert _rel_err(expanded, ref) < mla_tol(q, latent, kv_b, ref)
    assert _rel_err(absorbed, ref) < mla_tol(q, latent, kv_b, ref)


def test_random_mask_and_fully_masked_rows_are_finite() -> None:
    rng = np.random.default_rng(7)
    batch, steps, kv_len = 2, 5, 9
    q, latent, kv_b = _inputs(rng, batch, steps, kv_len)
    mask = rng.random((batch, steps, kv_len)) < 0.5
    mask[0, 2] = False  # one empty query row
    mask[1] = False  # a whole empty batch row
    ref = _oracle(q, latent, kv_b, mask)
    for fn in (mla_attention_expanded, mla_attention_absorbed):
        out = np.asarray(_run(fn, q, latent, kv_b, mask))
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[0, 2], 0.0)
        np.testing.assert_array_equal(out[1], 0.0)
        assert _rel_err(out, ref) < mla_tol(q, latent, kv_b, ref)


def test_bf16_forms_agree() -> None:
    rng = np.random.default_rng(8)
    q, latent, kv_b = _inputs(rng, 2, 4, 12)
    mask = causal_mask(jnp.asarray([3, 8], jnp.int32), 4, 12)
    to16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    expanded = _run(mla_attention_expanded, to16(q), to16(latent), to16(kv_b), mask)
    absorbed = _run(mla_attention_absorbed, to16(q), to16(latent), to16(kv_b), mask)
    assert expanded.dtype == absorbed.dtype == jnp.bfloat16
    ref = _oracle(q, latent, kv_b, mask)
    assert _rel_err(expanded.astype(jnp.float32), ref) < 3e-2
    assert _rel_err(absorbed.astype(jnp.float32), ref) < 3e-2


@pytest.mark.parametrize(("steps", "block"), [(13, 4), (16, 4), (5, 8), (9, 1)])
def test_causal_blocks_match_the_oracle(steps: int, block: int) -> None:
    """The full pass's blocked attention (block i against keys [0, (i + 1) * block) only) equals the float64
    oracle on a causal mask from 0, with padding past each row's length, for T a multiple of the block or
    not, shorter than it, and blocks of one query."""
    rng = np.random.default_rng(steps * 10 + block)
    q, latent, kv_b = _inputs(rng, 2, steps, steps)
    mask = causal_mask(jnp.zeros((2,), jnp.int32), steps, steps, jnp.asarray([steps, steps - 3], jnp.int32))
    blocked = functools.partial(mla_attention_causal_blocks, block=block)
    out = np.asarray(_run(blocked, q, latent, kv_b, mask))
    assert out.shape == (2, steps, _H, _V)
    ref = _oracle(q, latent, kv_b, mask)
    assert _rel_err(out, ref) < mla_tol(q, latent, kv_b, ref)


def test_shape_errors() -> None:
    rng = np.random.default_rng(9)
    q, latent, kv_b = _inputs(rng, 1, 1, 4)
    mask = jnp.ones((1, 1, 4), bool)
    with pytest.raises(ValueError):
        mla_attention_absorbed(q, latent[..., :-1], kv_b, mask, nope_dim=_NOPE, v_dim=_V, scale=_SCALE)
    with pytest.raises(ValueError):
        mla_attention_expanded(q, latent, kv_b[:-1], mask, nope_dim=_NOPE, v_dim=_V, scale=_SCALE)


def test_causal_mask_hand_written() -> None:
    start = jnp.asarray([0, 2], jnp.int32)
    got = np.asarray(causal_mask(start, 3, 6))
    expected = np.array(
        [
            [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
            [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]],
        ],
        bool,
    )
    assert got.shape == (2, 3, 6) and got.dtype == bool
    np.testing.assert_array_equal(got, expected)

    # valid = [3, 1]: row 1 has one real new token (position 2), so keys 3.. stay hidden.
    got_valid = np.asarray(causal_mask(start, 3, 6, jnp.asarray([3, 1], jnp.int32)))
    expected_valid = expected.copy()
    expected_valid[1] = np.array([[1, 1, 1, 0, 0, 0]] * 3, bool)
    np.testing.assert_array_equal(got_valid, expected_valid)

    # Decode step under jit with traced starts.
    decode = np.asarray(jax.jit(causal_mask, static_argnums=(1, 2))(jnp.asarray([4, 0], jnp.int32), 1, 6))
    np.testing.assert_array_equal(decode, np.array([[[1, 1, 1, 1, 1, 0]], [[1, 0, 0, 0, 0, 0]]], bool))


@pytest.mark.skipif(mla_decode_kernel() is None, reason="no C++ compiler here")
def test_paged_decode_kernel_matches_the_oracle() -> None:
    """The CPU kernel reading a paged pool through block tables (rows in shuffled, shared-nothing blocks, one
    row with nothing visible, one whose table points past the pool) against the float64 oracle on each row's
    positions t < end, and against the reference (gather, then the absorbed form)."""
    rng = np.random.default_rng(5)
    batch, block, width, blocks = 4, 4, 5, 24
    pool = rng.standard_normal((blocks, block, _R + _ROPE)).astype(np.float32)
    table = rng.permutation(np.arange(1, blocks))[: batch * width].reshape(batch, width).astype(np.int32)
    table[3, 4] = blocks + 7  # out of range: clamped, as the reference's gather clamps
    end = np.array([13, 0, 20, 17], np.int32)
    q, _, kv_b = _inputs(rng, batch, 1, 1)
    view = pool[np.clip(table, 0, blocks - 1)].reshape(batch, width * block, -1)
    mask = np.arange(width * block)[None, None, :] < end[:, None, None]
    want = _oracle(q, view, kv_b, mask)
    args = tuple(jnp.asarray(a) for a in (q, pool, table, end, kv_b))
    kw = {"nope_dim": _NOPE, "v_dim": _V, "scale": _SCALE}
    fast = jax.jit(lambda *a: mla_attention_paged(*a, **kw))
    got = fast(*args)
    ref = jax.jit(lambda *a: mla_attention_paged_reference(*a, **kw))(*args)
    assert "jaxhybrid_mla_decode" in fast.lower(*args).as_text()
    assert got.shape == (batch, 1, _H, _V) and got.dtype == jnp.float32
    assert _rel_err(got, want) < mla_tol(q, view, kv_b, want)
    assert _rel_err(got, ref) < mla_tol(q, view, kv_b, want, sides=2)
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)
    # int8 codes of the weight, read by the kernel as they are: the oracle on the dequantized weight
    codes = int8.quantize(jnp.asarray(kv_b))
    got8 = fast(*args[:4], codes)
    assert "jaxhybrid_mla_decode" in fast.lower(*args[:4], codes).as_text()
    dequantized = np.asarray(int8.dequantize(codes))
    want8 = _oracle(q, view, dequantized, mask)
    tol8 = mla_tol(q, view, dequantized, want8, extra=2)
    assert _rel_err(got8, want8) < tol8
    assert _rel_err(got8, want) > 2 * tol8  # the codes: the float weight would give `want` within the bound
    # a verify step's tokens: token t of a row sees the positions < end[b, t] (its own and those before it)
    t = 5
    qt, _, _ = _inputs(rng, batch, t, 1)
    ends = np.minimum(
        np.array([8, 0, 15, 12], np.int32)[:, None] + np.arange(1, t + 1), [[13], [0], [20], [14]]
    )
    ends = ends.astype(np.int32)
    argst = (jnp.asarray(qt), *args[1:3], jnp.asarray(ends), args[4])
    got_t = fast(*argst)
    assert "jaxhybrid_mla_decode" in fast.lower(*argst).as_text()
    mask_t = np.arange(width * block)[None, None, :] < ends[:, :, None]
    want_t = _oracle(qt, view, kv_b, mask_t)
    ref_t = jax.jit(lambda *a: mla_attention_paged_reference(*a, **kw))(*argst)
    assert got_t.shape == (batch, t, _H, _V)
    assert _rel_err(got_t, want_t) < mla_tol(qt, view, kv_b, want_t)
    assert _rel_err(got_t, ref_t) < mla_tol(qt, view, kv_b, want_t, sides=2)
    # past PAGED_KERNEL_MAX_TOKENS tokens per row: the reference itself
    long_q, _, _ = _inputs(rng, batch, PAGED_KERNEL_MAX_TOKENS + 1, 1)
    long_args = (jnp.asarray(long_q), *args[1:])
    assert "jaxhybrid_mla_decode" not in fast.lower(*long_args).as_text()

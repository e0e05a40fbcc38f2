"""Tests for the KDA ops (recurrent and chunked forms) and the causal depthwise conv.

The oracles are NumPy float64 per-token loops written straight from the defining formulas, so they
share no code with the JAX implementations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, gamma

from jaxhybrid.ops.conv import causal_conv1d, causal_conv1d_into_pool, causal_conv1d_reference
from jaxhybrid.ops.kda import (
    kda_chunked,
    kda_decode,
    kda_decode_into_pool,
    kda_decode_states,
    kda_recurrent,
    kda_recurrent_states,
)
from jaxhybrid.ops.native import kda_decode_kernel, kda_pool_kernels, kda_states_kernel

B, H = 2, 2


def kda_tol(t: int, dk: int = 16, chunk: int | None = 64, sides: int = 1) -> float:
    """Relative bound (`bounds.float32_sums_bound`) of float32 KDA over t tokens, against the float64 loop
    (sides 1) or another float32 form (2). The recurrent forms (and the kernels) chain a token's steps: the
    decay, k^T S (dk terms), the delta, the rank-one update: gamma(dk + 4) a token, passed on through the
    state (|k| = 1, 0 < beta < 1, decays <= 1: the update is a contraction, so to first order the errors
    add), then q^T S (dk terms). The chunked form (`chunk` C rounded to a power of two, or None: no chunked
    form) chains per chunk k k^T, the log2(C) products of the triangular inverse's recursive doubling, w and
    u, the state's update and the output: 5 + log2(C) sums of at most C + dk terms (the inverse's entries
    stay O(1) here: unit diagonal, off-diagonal terms beta k_i^T k_j times decays, all <= 1). The larger."""
    rec = t * gamma(dk + 4) + gamma(dk)
    if not chunk or t == 0:
        return sides * rec
    c = min(1 << (chunk.bit_length() - 1), 1 << max(t - 1, 0).bit_length())
    chk = -(-t // c) * (5 + c.bit_length() - 1) * gamma(c + dk) + gamma(dk)
    return sides * max(rec, chk)


def kda_grad_tol(t: int, chunk: int) -> float:
    """Gradients of a linear loss, chunked against recurrent: the backward pass chains the forward's sums
    once more in reverse (twice the forward's bound), and a gate's gradient sums S * dS over dv (16) terms."""
    return 2 * kda_tol(t, 16, chunk, sides=2) + 2 * gamma(16)


recurrent_jit = jax.jit(kda_recurrent)
decode_jit = jax.jit(kda_decode)
chunked_jit = jax.jit(kda_chunked, static_argnames="chunk_size")


def rel_err(a: np.ndarray | jax.Array, b: np.ndarray | jax.Array) -> float:
    """max|a - b| / max|b| in float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a64 - b64)) / max(np.max(np.abs(b64)), 1e-30))


# ----------------------------------------------------------------------------- KDA


def kda_oracle(q, k, v, g, beta, s0=None):
    """Float64 per-token loop over the three KDA formula lines (independent of the JAX code)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((b, t, h, dv))
    s_out = np.zeros((b, h, dk, dv))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((dk, dv)) if s0 is None else np.asarray(s0[bi, hi], np.float64).copy()
            for ti in range(t):
                s = np.exp(g[bi, ti, hi])[:, None] * s
                kt = k[bi, ti, hi]
                s = s + beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi] - kt @ s)
                o[bi, ti, hi] = s.T @ q[bi, ti, hi]
            s_out[bi, hi] = s
    return o, s_out


def make_inputs(seed: int, t: int, dk: int = 16, dv: int = 16, strong: bool = False, state: bool = False):
    """Realistic float32 inputs: unit-norm q (scaled by dk**-0.5) and k, g < 0, beta in (0, 1).

    Without ``state`` the initial state is an explicit zero array (same jit trace as a real state,
    which keeps compile time down); the ``None`` path is checked in its own test.
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, H, dk))
    k = rng.normal(size=(B, t, H, dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, t, H, dv))
    a = rng.uniform(-1.0, 1.0, size=(H, dk))  # per-channel decay scale, like A_log
    g = -np.exp(a) * np.logaddexp(0.0, rng.normal(size=(B, t, H, dk)))  # -exp(a) * softplus(x)
    g = np.maximum(g, -5.0)
    if strong:
        hit = rng.uniform(size=g.shape) < 0.15
        g = np.where(hit, -20.0 + rng.uniform(-1.0, 1.0, size=g.shape), g)
    beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(B, t, H))))
    s0 = rng.normal(size=(B, H, dk, dv)) if state else np.zeros((B, H, dk, dv))
    cast = lambda x: jnp.asarray(x, jnp.float32)
    return tuple(cast(x) for x in (q, k, v, g, beta)), cast(s0)


@pytest.mark.parametrize("strong", [False, True], ids=["g_mild", "g_strong"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_kda_forms_match_oracle(t: int, with_state: bool, strong: bool) -> None:
    (q, k, v, g, beta), s0 = make_inputs(t + 7 * with_state + 3 * strong, t, strong=strong, state=with_state)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    o_rec, s_rec = recurrent_jit(q, k, v, g, beta, s0)
    o_chk, s_chk = chunked_jit(q, k, v, g, beta, s0)
    assert o_rec.shape == o_chk.shape == (B, t, H, 16) and o_chk.dtype == jnp.float32
    assert s_rec.shape == s_chk.shape == (B, H, 16, 16) and s_chk.dtype == jnp.float32
    errs = {
        "rec/oracle o": rel_err(o_rec, o_ref),
        "rec/oracle S": rel_err(s_rec, s_ref),
        "chk/oracle o": rel_err(o_chk, o_ref),
        "chk/oracle S": rel_err(s_chk, s_ref),
        "chk/rec o": rel_err(o_chk, o_rec),
        "chk/rec S": rel_err(s_chk, s_rec),
    }
    print(f"T={t} state={with_state} strong={strong}: " + ", ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    tol = {n: kda_tol(t, sides=2 if n.startswith("chk/rec") else 1) for n in errs}
    assert all(errs[n] < tol[n] for n in errs), (errs, tol)


@pytest.mark.skipif(kda_decode_kernel() is None, reason="no C++ compiler here")
@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 24), (128, 128)])
@pytest.mark.parametrize("strong", [False, True], ids=["g_mild", "g_strong"])
def test_kda_decode_kernel_matches_oracle(dk: int, dv: int, strong: bool) -> None:
    """The native one-token step (several steps chained, each from the last one's state) against the
    float64 loop: o and S within the fp32 tolerance, and the same as `kda_recurrent` to a few ulps."""
    t = 3
    (q, k, v, g, beta), s0 = make_inputs(dk + dv + strong, t, dk=dk, dv=dv, strong=strong, state=True)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    s, outs = s0, []
    for i in range(t):
        o, s = decode_jit(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s)
        assert o.shape == (B, 1, H, dv) and s.shape == (B, H, dk, dv) and s.dtype == jnp.float32
        outs.append(o)
    o = jnp.concatenate(outs, axis=1)
    assert rel_err(o, o_ref) < kda_tol(t, dk, None) and rel_err(s, s_ref) < kda_tol(t, dk, None)
    o_rec, s_rec = recurrent_jit(q, k, v, g, beta, s0)  # the same steps, its sums in other orders
    assert rel_err(o, o_rec) < kda_tol(t, dk, None, 2) and rel_err(s, s_rec) < kda_tol(t, dk, None, 2)
    hlo = decode_jit.lower(*(x[:, :1] for x in (q, k, v, g, beta)), s0).as_text()
    assert "jaxhybrid_kda_decode" in hlo  # the kernel ran, not the fallback


@pytest.mark.skipif(kda_decode_kernel() is None, reason="no C++ compiler here")
def test_kda_decode_kernel_padding_none_state_and_dtypes() -> None:
    """A padded row (g = 0, beta = 0) keeps its state bit for bit; no state is zeros; bf16 inputs give o in
    v.dtype and a float32 state; more than one token per row takes `kda_recurrent`."""
    (q, k, v, g, beta), s0 = make_inputs(23, 1, dk=32, dv=16, state=True)
    g = g.at[1].set(0.0)
    beta = beta.at[1].set(0.0)
    _, s = decode_jit(q, k, v, g, beta, s0)
    np.testing.assert_array_equal(np.asarray(s[1]), np.asarray(s0[1]))
    o_none, s_none = decode_jit(q, k, v, g, beta, None)
    o_zero, s_zero = decode_jit(q, k, v, g, beta, jnp.zeros_like(s0))
    np.testing.assert_array_equal(np.asarray(o_none), np.asarray(o_zero))
    np.testing.assert_array_equal(np.asarray(s_none), np.asarray(s_zero))
    lo = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]
    o_lo, s_lo = decode_jit(*lo, s0)
    o_ref, s_ref = kda_oracle(*(x.astype(jnp.float32) for x in lo), s0)
    assert o_lo.dtype == jnp.bfloat16 and s_lo.dtype == jnp.float32
    # the state in float32; o rounded once to bfloat16 (unit roundoff 2^-8) after the float32 step
    tol = kda_tol(1, 32, None)
    assert rel_err(s_lo, s_ref) < tol and rel_err(o_lo, o_ref) < 2.0**-8 + tol
    (q, k, v, g, beta), s0 = make_inputs(29, 5, state=True)
    o5, s5 = decode_jit(q, k, v, g, beta, s0)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    assert rel_err(o5, o_ref) < kda_tol(5) and rel_err(s5, s_ref) < kda_tol(5)  # chunked or recurrent


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_kda_decode_reads_rows_of_a_pool_in_place(monkeypatch, kernel: bool) -> None:
    """`rows`: each row starts from its slot of a pool of states (slots in any order, one slot read by two
    rows); the same as the float64 loop from the gathered states, and the pool itself is left as it was."""
    import jaxhybrid.ops.native as native

    if not kernel:
        monkeypatch.setattr(native, "kda_decode_kernel", lambda: None)
    elif kda_decode_kernel() is None:
        pytest.skip("no C++ compiler here")
    (q, k, v, g, beta), _ = make_inputs(31, 1, dk=32, dv=16, state=True)
    pool = jnp.asarray(np.random.default_rng(5).standard_normal((5, H, 32, 16)), jnp.float32)
    rows = jnp.asarray(([3, 0, 3, 1] * B)[:B], jnp.int32)
    before = np.asarray(pool)
    o, s = jax.jit(kda_decode)(q, k, v, g, beta, pool, rows)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, pool[rows])
    tol = kda_tol(1, 32, None)
    assert s.shape == (B, H, 32, 16) and rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
    np.testing.assert_array_equal(np.asarray(pool), before)
    with pytest.raises(ValueError, match="pool"):
        kda_decode(q, k, v, g, beta, None, rows)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
@pytest.mark.parametrize("pooled", [False, True], ids=["states", "pool_rows"])
def test_kda_decode_states_keeps_the_state_after_each_token(monkeypatch, kernel: bool, pooled: bool) -> None:
    """`kda_decode_states` (a verify step's form): o and the state after every token as the float64 loop
    gives them for each prefix, from given states or from slots of a pool (any order, one slot read by two
    rows, the pool left as it was); a padded token (g = 0, beta = 0) repeats the state before it bit for bit;
    the kernel ran where there is one, and agrees with `kda_recurrent_states` to a few ulps."""
    import jaxhybrid.ops.native as native

    if not kernel:
        monkeypatch.setattr(native, "kda_states_kernel", lambda: None)
    elif kda_states_kernel() is None:
        pytest.skip("no C++ compiler here")
    t, dk, dv = 5, 32, 16
    (q, k, v, g, beta), s0 = make_inputs(37, t, dk=dk, dv=dv, state=True)
    g, beta = g.at[1, 2].set(0.0), beta.at[1, 2].set(0.0)
    if pooled:
        pool = jnp.asarray(np.random.default_rng(6).standard_normal((4, H, dk, dv)), jnp.float32)
        rows = jnp.asarray(([3, 0, 3, 1] * B)[:B], jnp.int32)
        before, s0, args = np.asarray(pool), pool[rows], (pool, rows)
    else:
        args = (s0,)
    fn = jax.jit(lambda *a: kda_decode_states(*a))  # a trace of its own: jit caches by function
    o, states = fn(q, k, v, g, beta, *args)
    assert o.shape == (B, t, H, dv) and states.shape == (B, t, H, dk, dv) and states.dtype == jnp.float32
    o_ref, _ = kda_oracle(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < kda_tol(t, dk, None)
    for i in range(t):
        _, s_i = kda_oracle(*(x[:, : i + 1] for x in (q, k, v, g, beta)), s0)
        assert rel_err(states[:, i], s_i) < kda_tol(i + 1, dk, None)
    np.testing.assert_array_equal(np.asarray(states[1, 2]), np.asarray(states[1, 1]))
    o_rec, s_rec = kda_recurrent_states(q, k, v, g, beta, s0)  # the same steps, sums in other orders
    assert rel_err(o, o_rec) < kda_tol(t, dk, None, 2) and rel_err(states, s_rec) < kda_tol(t, dk, None, 2)
    assert ("jaxhybrid_kda_states" in fn.lower(q, k, v, g, beta, *args).as_text()) == kernel
    if pooled:
        np.testing.assert_array_equal(np.asarray(pool), before)
        with pytest.raises(ValueError, match="pool"):
            kda_decode_states(q, k, v, g, beta, None, rows)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_kda_decode_into_pool_writes_each_row_over_its_slot(monkeypatch, kernel: bool) -> None:
    """`kda_decode_into_pool`: rows in any order from their slots; o and the rows' new states (in their
    slots) as the float64 loop gives them from the gathered states, a padded row (g = 0, beta = 0) and every
    other slot bit for bit as they were; donated, the kernel writes the pool's own buffer."""
    import jaxhybrid.ops.native as native

    if not kernel:
        monkeypatch.setattr(native, "kda_pool_kernels", lambda: None)
    elif kda_pool_kernels() is None:
        pytest.skip("no C++ compiler here")
    (q, k, v, g, beta), _ = make_inputs(37, 1, dk=32, dv=16, state=True)
    g, beta = g.at[1].set(0.0), beta.at[1].set(0.0)
    pool = jnp.asarray(np.random.default_rng(6).standard_normal((5, H, 32, 16)), jnp.float32)
    rows = jnp.asarray([3, 0], jnp.int32)
    before = np.array(pool)  # a copy: a view of the pool would keep it from being donated
    step = jax.jit(lambda *a: kda_decode_into_pool(*a), donate_argnums=(5,))  # a trace of its own
    hlo = step.lower(q, k, v, g, beta, pool, rows).as_text()
    assert ("jaxhybrid_kda_decode_pool" in hlo) is kernel
    address = pool.unsafe_buffer_pointer()
    o, new = step(q, k, v, g, beta, pool, rows)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, before[np.asarray(rows)])
    assert o.shape == (B, 1, H, 16) and new.shape == before.shape
    assert rel_err(o, o_ref) < kda_tol(1, 32, None) and rel_err(new[3], s_ref[0]) < kda_tol(1, 32, None)
    want = before.copy()
    want[3] = np.asarray(new[3])
    np.testing.assert_array_equal(np.asarray(new), want)  # slot 0 (the padded row) and the rest unchanged
    if kernel:
        assert new.unsafe_buffer_pointer() == address


def test_kda_rectangular_head_dims() -> None:
    """dk != dv and a chunk length that does not divide T."""
    (q, k, v, g, beta), s0 = make_inputs(11, 45, dk=32, dv=16, state=True)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    o_chk, s_chk = chunked_jit(q, k, v, g, beta, s0, chunk_size=16)
    o_rec, s_rec = recurrent_jit(q, k, v, g, beta, s0)
    for a, ref in ((o_chk, o_ref), (s_chk, s_ref), (o_rec, o_ref), (s_rec, s_ref)):
        assert rel_err(a, ref) < kda_tol(45, 32, 16)


@pytest.mark.parametrize("t1,t2", [(37, 63), (64, 66)])
def test_kda_chunked_two_part_prefill(t1: int, t2: int) -> None:
    (q, k, v, g, beta), s0 = make_inputs(5, t1 + t2, state=True)
    o_full, s_full = chunked_jit(q, k, v, g, beta, s0)
    part = lambda x, lo, hi: x[:, lo:hi]
    o1, s1 = chunked_jit(*(part(x, 0, t1) for x in (q, k, v, g, beta)), s0)
    o2, s2 = chunked_jit(*(part(x, t1, t1 + t2) for x in (q, k, v, g, beta)), s1)
    e_o = rel_err(jnp.concatenate([o1, o2], axis=1), o_full)
    e_s = rel_err(s2, s_full)
    print(f"two-part {t1}+{t2}: o={e_o:.2e} S={e_s:.2e}")
    assert e_o < kda_tol(t1 + t2, sides=2) and e_s < kda_tol(t1 + t2, sides=2)


@pytest.mark.parametrize("chunk_size", [1, 16, 50, 100])
def test_kda_chunk_size_invariance(chunk_size: int) -> None:
    (q, k, v, g, beta), s0 = make_inputs(9, 100, strong=True, state=True)
    o64, s64 = chunked_jit(q, k, v, g, beta, s0)
    o_c, s_c = chunked_jit(q, k, v, g, beta, s0, chunk_size=chunk_size)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    errs = [rel_err(o_c, o64), rel_err(s_c, s64), rel_err(o_c, o_ref), rel_err(s_c, s_ref)]
    print(f"chunk_size={chunk_size}: " + ", ".join(f"{e:.2e}" for e in errs))
    two = max(kda_tol(100, sides=2), kda_tol(100, chunk=chunk_size, sides=2))
    assert max(errs[:2]) < two and max(errs[2:]) < kda_tol(100, chunk=chunk_size)


def test_kda_padding_leaves_state_unchanged() -> None:
    """g = 0 and beta = 0 on trailing positions (q, k, v left as garbage) must not move the state."""
    t, valid = 90, 53
    (q, k, v, g, beta), s0 = make_inputs(13, t, state=True)
    pad = jnp.arange(t)[None, :, None] >= valid
    g_p = jnp.where(pad[..., None], 0.0, g)
    beta_p = jnp.where(pad, 0.0, beta)
    o_ref, s_ref = kda_oracle(q[:, :valid], k[:, :valid], v[:, :valid], g[:, :valid], beta[:, :valid], s0)
    for fn in (recurrent_jit, chunked_jit):
        o_pad, s_pad = fn(q, k, v, g_p, beta_p, s0)
        assert rel_err(s_pad, s_ref) < kda_tol(t)
        assert rel_err(o_pad[:, :valid], o_ref) < kda_tol(t)
        assert bool(jnp.all(jnp.isfinite(o_pad)))


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunked])
def test_kda_none_initial_state_is_zeros(fn) -> None:
    (q, k, v, g, beta), s0 = make_inputs(19, 40)
    o_none, s_none = fn(q, k, v, g, beta)
    o_zero, s_zero = fn(q, k, v, g, beta, s0)
    np.testing.assert_array_equal(np.asarray(o_none), np.asarray(o_zero))
    np.testing.assert_array_equal(np.asarray(s_none), np.asarray(s_zero))


def test_kda_low_precision_io_dtype() -> None:
    """bf16 inputs: outputs come back in v.dtype, the state stays float32."""
    (q, k, v, g, beta), s0 = make_inputs(17, 20, state=True)
    args = [x.astype(jnp.bfloat16) for x in (q, k, v, g, beta)]
    o_rec, s_rec = recurrent_jit(*args, s0)
    o_chk, s_chk = chunked_jit(*args, s0, chunk_size=8)
    assert o_rec.dtype == o_chk.dtype == jnp.bfloat16
    assert s_rec.dtype == s_chk.dtype == jnp.float32
    assert rel_err(s_chk, s_rec) < kda_tol(20, chunk=8, sides=2)  # float32 inside, from the same inputs


def assert_gradients_match_recurrent(inputs, s0, chunk_size: int, seed: int, label: str) -> None:
    """Gradients of a random linear loss on (o, final state), through every input and the initial state:
    kda_chunked at `chunk_size` against kda_recurrent, within `kda_grad_tol` and finite."""
    q = inputs[0]
    b, t, h = q.shape[:3]
    rng = np.random.default_rng(seed)
    w_o = jnp.asarray(rng.normal(size=(b, t, h, 16)), jnp.float32)
    w_s = jnp.asarray(rng.normal(size=(b, h, 16, 16)), jnp.float32)

    def loss(fn, *args):
        o, s = fn(*args)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    argnums = tuple(range(6))
    g_rec = jax.jit(jax.grad(functools.partial(loss, kda_recurrent), argnums=argnums))(*inputs, s0)
    chunked = functools.partial(kda_chunked, chunk_size=chunk_size)
    g_chk = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=argnums))(*inputs, s0)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    errs = {n: rel_err(a, b) for n, a, b in zip(names, g_chk, g_rec, strict=True)}
    print(f"{label}: " + ", ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g_chk)
    assert max(errs.values()) < kda_grad_tol(t, chunk_size), errs


def test_kda_gradients_chunked_match_recurrent() -> None:
    inputs, s0 = make_inputs(21, 70, state=True)
    assert_gradients_match_recurrent(inputs, s0, 16, seed=0, label="grad chunked/recurrent")


def decay_override(x: jax.Array, seed: int, level: float, frac: float) -> jax.Array:
    """g with a fraction ``frac`` of entries replaced by ``level`` +- 1 (the rest as given)."""
    rng = np.random.default_rng(seed)
    hit = rng.uniform(size=x.shape) < frac
    return jnp.where(hit, jnp.asarray(level + rng.uniform(-1.0, 1.0, size=x.shape), jnp.float32), x)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("frac", [1.0, 0.05], ids=["g30_all", "g30_sparse"])
def test_kda_chunked_very_strong_decay(chunk_size: int, frac: float) -> None:
    """g ~ -30 per step on (nearly) every channel over whole chunks: exp of any cumulative sum would
    overflow or underflow, so only segment-wise exponents <= 0 survive. T is a multiple of no chunk
    length, and the state starts non-zero."""
    t = 150
    (q, k, v, g, beta), s0 = make_inputs(31 + chunk_size, t, strong=True, state=True)
    g = decay_override(g, 41 + chunk_size, -30.0, frac)
    o_ref, s_ref = kda_oracle(q, k, v, g, beta, s0)
    o_chk, s_chk = chunked_jit(q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert bool(jnp.all(jnp.isfinite(o_chk))) and bool(jnp.all(jnp.isfinite(s_chk)))
    errs = [rel_err(o_chk, o_ref), rel_err(s_chk, s_ref)]
    print(f"g~-30 frac={frac} chunk_size={chunk_size}: o={errs[0]:.2e} S={errs[1]:.2e}")
    assert max(errs) < kda_tol(t, chunk=chunk_size)


@pytest.mark.parametrize("chunk_size", [32, 128])
def test_kda_chunked_weak_decay_long_range(chunk_size: int) -> None:
    """Nearly no decay (g in (-0.02, 0]) and one repeated key with beta near 1: every pair in a chunk
    interacts at full strength and the triangular inverse is far from the identity."""
    t = 200
    (q, k, v, g, beta), s0 = make_inputs(61 + chunk_size, t, state=True)
    rng = np.random.default_rng(chunk_size)
    g = jnp.asarray(-rng.uniform(0.0, 0.02, size=g.shape), jnp.float32)
    for kk, bb in ((k, beta), (jnp.broadcast_to(k[:, :1], k.shape), jnp.clip(beta, 0.9, 1.0))):
        o_ref, s_ref = kda_oracle(q, kk, v, g, bb, s0)
        o_chk, s_chk = chunked_jit(q, kk, v, g, bb, s0, chunk_size=chunk_size)
        errs = [rel_err(o_chk, o_ref), rel_err(s_chk, s_ref)]
        print(f"weak decay chunk_size={chunk_size}: o={errs[0]:.2e} S={errs[1]:.2e}")
        assert max(errs) < kda_tol(t, chunk=chunk_size)


def test_kda_chunked_empty_sequence() -> None:
    (q, k, v, g, beta), s0 = make_inputs(3, 0, state=True)
    o, s = kda_chunked(q, k, v, g, beta, s0)
    assert o.shape == (B, 0, H, 16)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))


@pytest.mark.parametrize("chunk_size,g_level", [(64, None), (128, -30.0)], ids=["c64_strong", "c128_g30"])
def test_kda_gradients_multi_level_chunks(chunk_size: int, g_level: float | None) -> None:
    """Gradients through chunks with several doubling levels, strong decays, padding in the last chunk."""
    (q, k, v, g, beta), s0 = make_inputs(23, 150, strong=True, state=True)
    if g_level is not None:
        g = decay_override(g, 24, g_level, 0.05)
    assert_gradients_match_recurrent(
        (q, k, v, g, beta), s0, chunk_size, seed=1, label=f"grad chunk_size={chunk_size}"
    )


# ----------------------------------------------------------------------------- conv


def conv_oracle(x, weight, state=None, lengths=None):
    """Float64 NumPy oracle: explicit padded sequence, K-tap dot per output, tail slice per row."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    b, t, c = x.shape
    kk = w.shape[1]
    st = np.zeros((b, c, kk - 1)) if state is None else np.asarray(state, np.float64)
    xp = np.concatenate([st.transpose(0, 2, 1), x], axis=1)
    y = np.zeros((b, t, c))
    for ti in range(t):
        for j in range(kk):
            y[:, ti, :] += w[:, j] * xp[:, ti + j, :]
    n = [t] * b if lengths is None else [int(m) for m in lengths]
    new_state = np.stack([xp[bi, n[bi] : n[bi] + kk - 1].T for bi in range(b)])
    return y, new_state


def conv_bound(x, weight, state=None, sides: int = 1) -> np.ndarray:
    """Elementwise bound of a float32 kk-tap causal conv: gamma(kk) times the taps' magnitudes (the oracle
    on |x|, |w|, |state|), on each side (`bounds`)."""
    mag, _ = conv_oracle(np.abs(x), np.abs(weight), None if state is None else np.abs(state))
    return sides * gamma(np.shape(weight)[1]) * mag


def conv_inputs(seed: int, b: int, t: int, c: int, kk: int, state: bool):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, c)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(c, kk)), jnp.float32)
    s = jnp.asarray(rng.normal(size=(b, c, kk - 1)), jnp.float32) if state else None
    return x, w, s


@pytest.mark.parametrize("kk", [1, 4])
@pytest.mark.parametrize("t", [2, 11])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_conv_fast_reference_oracle(kk: int, t: int, with_state: bool, padded: bool) -> None:
    x, w, s = conv_inputs(t + kk, 3, t, 8, kk, with_state)
    lengths = jnp.asarray([t, t // 2, 0], jnp.int32) if padded else None
    y_ref, s_ref = conv_oracle(x, w, s, None if lengths is None else np.asarray(lengths))
    for fn in (causal_conv1d, causal_conv1d_reference):
        y, s_new = jax.jit(fn)(x, w, s, lengths)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert s_new.shape == (3, 8, kk - 1) and s_new.dtype == x.dtype
        assert_within(y, y_ref, conv_bound(x, w, s))  # a kk-tap dot product
        if kk > 1:
            np.testing.assert_array_equal(np.asarray(s_new), s_ref.astype(np.float32))
    if padded and kk > 1:
        # A row with no valid tokens keeps its incoming state exactly.
        s_in = np.zeros((3, 8, kk - 1), np.float32) if s is None else np.asarray(s)
        np.testing.assert_array_equal(np.asarray(causal_conv1d(x, w, s, lengths)[1][2]), s_in[2])


def test_conv_decode_steps_match_full_sequence() -> None:
    t, kk = 9, 4
    x, w, s = conv_inputs(3, 2, t, 6, kk, True)
    y_full, s_full = causal_conv1d(x, w, s)
    step = jax.jit(causal_conv1d)
    state, ys = s, []
    for ti in range(t):
        y_t, state = step(x[:, ti : ti + 1], w, state)
        ys.append(y_t)
    assert_within(jnp.concatenate(ys, axis=1), y_full, conv_bound(x, w, s, sides=2))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(s_full))
    # The carried state is literally the last K-1 inputs, oldest first.
    np.testing.assert_array_equal(np.asarray(state), np.asarray(jnp.swapaxes(x[:, -(kk - 1) :], 1, 2)))


def test_conv_padded_prefill_then_decode() -> None:
    """Prefill with right padding, then decode: equals running each row's valid prefix alone."""
    t, kk = 10, 4
    x, w, s = conv_inputs(8, 2, t, 5, kk, True)
    lengths = jnp.asarray([10, 4], jnp.int32)
    _, state = causal_conv1d(x, w, s, lengths)
    x_next = conv_inputs(9, 2, 1, 5, kk, False)[0]
    y_next, _ = causal_conv1d(x_next, w, state)
    for bi, n in enumerate([10, 4]):
        seq = jnp.concatenate([x[bi : bi + 1, :n], x_next[bi : bi + 1]], axis=1)
        y_ref, _ = conv_oracle(seq, w, s[bi : bi + 1])
        assert_within(y_next[bi, 0], y_ref[0, -1], conv_bound(seq, w, s[bi : bi + 1])[0, -1])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "xla"])
def test_conv_into_pool_moves_each_rows_window_on_in_its_slot(monkeypatch, kernel: bool) -> None:
    """`causal_conv1d_into_pool` for one token per row: y as the float64 loop from the gathered windows, each
    valid row's window moved on by its token in its slot, a row with length 0 and every other slot bit for
    bit as they were; donated, the kernel writes the pool's own buffer."""
    import jaxhybrid.ops.native as native

    if not kernel:
        monkeypatch.setattr(native, "kda_pool_kernels", lambda: None)
    elif kda_pool_kernels() is None:
        pytest.skip("no C++ compiler here")
    c, kk = 6, 4
    x, weight, _ = conv_inputs(41, 3, 1, c, kk, state=False)
    pool = jnp.asarray(np.random.default_rng(7).standard_normal((5, c, kk - 1)), jnp.float32)
    rows, lengths = jnp.asarray([4, 1, 2], jnp.int32), jnp.asarray([1, 0, 1], jnp.int32)
    before = np.array(pool)  # a copy: a view of the pool would keep it from being donated
    step = jax.jit(lambda *a: causal_conv1d_into_pool(*a), donate_argnums=(2,))  # a trace of its own
    assert ("jaxhybrid_conv_decode_pool" in step.lower(x, weight, pool, rows, lengths).as_text()) is kernel
    address = pool.unsafe_buffer_pointer()
    y, new = step(x, weight, pool, rows, lengths)
    y_ref, s_ref = conv_oracle(x, weight, before[np.asarray(rows)], np.asarray(lengths))
    assert y.shape == (3, 1, c)
    bound = conv_bound(x, weight, before[np.asarray(rows)])
    assert_within(np.asarray(y)[[0, 2]], y_ref[[0, 2]], bound[[0, 2]])
    want = before.copy()
    want[[4, 2]] = s_ref[[0, 2]]
    np.testing.assert_allclose(np.asarray(new), want, rtol=0, atol=0)
    if kernel:
        assert new.unsafe_buffer_pointer() == address

"""Tests for jaxhybrid.ops.moe: router vs a NumPy oracle, dropless experts vs the dense reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_sums_bound, gamma
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy_reference import silu, situ

from jaxhybrid.ops.activations import SILU, GatedActivation
from jaxhybrid.ops.moe import (
    moe_experts_blocked,
    moe_experts_dense,
    moe_experts_dropless,
    moe_experts_dropless_stacked,
    moe_experts_ragged,
    moe_experts_skipping,
    moe_experts_skipping_stacked,
    route,
)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def route_tol(x, w, top_k: int) -> float:
    """The routing weights' relative bound: a score is sigmoid(x . w), whose relative error is at most its
    logit's absolute error (d log sigmoid / dz = 1 - sigmoid <= 1), gamma(dim) of the terms' magnitudes
    |x| . |w|; then the sigmoid's roundings, the renormalizing sum over top_k, a divide and the scaling."""
    mag = float((np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T).max())
    return gamma(x.shape[-1]) * mag + float32_sums_bound(ACTIVATION_ROUNDINGS, top_k + 2)


def _route_oracle(
    x: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token float64 transcription of the routing rule in docs/design.md."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    num_experts = w.shape[0]
    scores = 1.0 / (1.0 + np.exp(-(x @ w.T)))
    biased = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    group_size = num_experts // n_group
    all_w, all_ids = [], []
    for n in range(x.shape[0]):
        group_score = [
            np.sort(biased[n, g * group_size : (g + 1) * group_size])[-2:].sum() for g in range(n_group)
        ]
        kept_groups = np.argsort(-np.asarray(group_score))[:topk_group]
        candidates = np.full(num_experts, -np.inf)
        for g in kept_groups:
            sl = slice(g * group_size, (g + 1) * group_size)
            candidates[sl] = biased[n, sl]
        ids = np.argsort(-candidates)[:top_k]
        wts = scores[n, ids]
        if renormalize:
            wts = wts / (wts.sum() + 1e-20)
        all_w.append(wts * scaling)
        all_ids.append(ids)
    return np.stack(all_w), np.stack(all_ids)


def _sorted_by_id(weights: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical per-token order so comparisons ignore the order of equally chosen experts."""
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(weights, order, -1), np.take_along_axis(ids, order, -1)


@pytest.mark.parametrize(
    ("n_group", "topk_group", "renormalize", "scaling", "use_bias"),
    [
        (1, 1, True, 1.0, False),
        (1, 1, True, 2.446, True),
        (4, 2, True, 2.446, True),
        (4, 2, False, 1.0, True),
        (8, 3, True, 1.5, True),
    ],
)
def test_route_matches_numpy_oracle(
    n_group: int, topk_group: int, renormalize: bool, scaling: float, use_bias: bool
) -> None:
    rng = np.random.default_rng(0)
    num_tokens, dim, num_experts, top_k = 48, 24, 32, 6
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    w = (rng.standard_normal((num_experts, dim)) / np.sqrt(dim)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(num_experts)).astype(np.float32) if use_bias else None

    weights, ids = route(
        jnp.asarray(x),
        jnp.asarray(w),
        None if bias is None else jnp.asarray(bias),
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        renormalize=renormalize,
        scaling=scaling,
    )
    assert weights.shape == (num_tokens, top_k) and weights.dtype == jnp.float32
    assert ids.shape == (num_tokens, top_k) and ids.dtype == jnp.int32
    ref_w, ref_ids = _route_oracle(x, w, bias, top_k, n_group, topk_group, renormalize, scaling)

    got_w, got_ids = _sorted_by_id(np.asarray(weights), np.asarray(ids))
    ref_w, ref_ids = _sorted_by_id(ref_w, ref_ids)
    np.testing.assert_array_equal(got_ids, ref_ids)
    assert _rel_err(got_w, ref_w) < route_tol(x, w, top_k)
    if renormalize:  # the weights' errors (one sign or both) and NumPy's float32 sum of top_k of them
        bound = route_tol(x, w, top_k) + gamma(top_k)
        np.testing.assert_allclose(np.asarray(weights).sum(-1), scaling, rtol=bound, atol=0)

    if n_group > 1:
        # Every chosen expert lies in one of the topk_group best groups.
        group_size = num_experts // n_group
        groups_used = np.asarray(ids) // group_size
        assert max(len(set(row)) for row in groups_used) <= topk_group


def test_group_limit_excludes_best_expert_in_losing_group() -> None:
    """Expert 0 has the single highest score, but its group's top-2 sum loses, so it is not picked."""
    logits = np.array(
        [5.0, -5.0, -5.0, -5.0]  # group 0: best expert, weak partner -> top-2 sum ~ 1.00
        + [1.0, 1.0, -5.0, -5.0]  # group 1: top-2 sum ~ 1.46
        + [0.8, 0.7, -5.0, -5.0]  # group 2: top-2 sum ~ 1.36
        + [-5.0, -5.0, -5.0, -5.0],  # group 3
        np.float32,
    )
    num_experts = logits.size
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = 1.0
    w = np.zeros((num_experts, 4), np.float32)
    w[:, 0] = logits  # x @ w.T == logits

    _, ids_flat = route(jnp.asarray(x), jnp.asarray(w), None, top_k=2)
    assert 0 in np.asarray(ids_flat)[0]

    weights, ids = route(jnp.asarray(x), jnp.asarray(w), None, top_k=2, n_group=4, topk_group=2)
    assert sorted(np.asarray(ids)[0].tolist()) == [4, 5]
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    want = s[[4, 5]] / s[[4, 5]].sum()
    np.testing.assert_allclose(np.asarray(weights)[0], want, rtol=route_tol(x, w, 2), atol=0)

    # Three groups kept: group 0 survives and expert 0 wins again.
    _, ids3 = route(jnp.asarray(x), jnp.asarray(w), None, top_k=2, n_group=4, topk_group=3)
    assert 0 in np.asarray(ids3)[0]


@pytest.mark.parametrize("renormalize", [True, False])
def test_bias_changes_choice_not_weights(renormalize: bool) -> None:
    rng = np.random.default_rng(1)
    num_tokens, dim, num_experts, top_k, scaling = 16, 8, 8, 2, 2.5
    x = rng.standard_normal((num_tokens, dim)).astype(np.float32)
    w = rng.standard_normal((num_experts, dim)).astype(np.float32)
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w.T.astype(np.float64))))
    kw = dict(top_k=top_k, renormalize=renormalize, scaling=scaling)

    _, ids_plain = route(jnp.asarray(x), jnp.asarray(w), None, **kw)
    # A large bias on the expert that is least popular unbiased forces it into every token's top-k.
    forced = int(np.bincount(np.asarray(ids_plain).ravel(), minlength=num_experts).argmin())
    bias = np.zeros(num_experts, np.float32)
    bias[forced] = 10.0
    weights, ids = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), **kw)
    ids = np.asarray(ids)
    assert (ids == forced).any(axis=-1).all()
    assert not (np.asarray(ids_plain) == forced).any(axis=-1).all()

    expected = np.take_along_axis(s, ids, -1)  # un-biased scores of the chosen experts
    if renormalize:
        expected = expected / expected.sum(-1, keepdims=True)
    expected = expected * scaling
    assert _rel_err(np.asarray(weights), expected) < route_tol(x, w, top_k)


def test_route_rejects_bad_grouping() -> None:
    x = jnp.zeros((2, 4))
    w = jnp.zeros((6, 4))
    with pytest.raises(ValueError):
        route(x, w, None, top_k=2, n_group=4, topk_group=2)
    with pytest.raises(ValueError):
        route(x, w, None, top_k=4, n_group=3, topk_group=1)


# ---------------------------------------------------------------------------------------------- experts

_N, _D, _F, _E, _K = 40, 32, 48, 8, 3
# The experts' chain: gate and up over _D, the activation, down over _F, the weighted sum over the _K picks;
# against the float64 loop (one side) or between two float32 forms (two sides).
EXPERTS_TOL = float32_sums_bound(_D, ACTIVATION_ROUNDINGS, _F, _K)
EXPERTS_TOL2 = float32_sums_bound(_D, ACTIVATION_ROUNDINGS, _F, _K, sides=2)


def _expert_weights(rng: np.random.Generator, dtype: np.dtype = np.float32) -> tuple[jax.Array, ...]:
    w1 = rng.standard_normal((_E, _F, _D)) / np.sqrt(_D)
    w3 = rng.standard_normal((_E, _F, _D)) / np.sqrt(_D)
    w2 = rng.standard_normal((_E, _D, _F)) / np.sqrt(_F)
    return tuple(jnp.asarray(a.astype(dtype)) for a in (w1, w2, w3))


def float64_experts(x, w1, w2, w3, weights, ids, valid=None, act: GatedActivation = SILU) -> np.ndarray:
    """Float64 per-token loop over the chosen experts (a repeated id counts each time) of the rows `valid`
    (default all), with the gated activation from numpy_reference; the other rows are zero."""
    x, w1, w2, w3, weights = (np.asarray(a, np.float64) for a in (x, w1, w2, w3, weights))
    ids = np.asarray(ids)
    out = np.zeros_like(x)
    for n in np.flatnonzero(np.ones(len(x), bool) if valid is None else valid):
        for j, e in enumerate(ids[n]):
            g, u = w1[e] @ x[n], w3[e] @ x[n]
            h = silu(g) * u if act.kind == "silu" else situ(g, u, act.beta, act.linear_beta)
            out[n] += weights[n, j] * (w2[e] @ h)
    return out


def _random_ids(rng: np.random.Generator) -> np.ndarray:
    return np.stack([rng.permutation(_E)[:_K] for _ in range(_N)]).astype(np.int32)


def _skewed_ids(rng: np.random.Generator) -> np.ndarray:
    """Expert 3 gets every token, experts 5/6 share the rest, all other experts get nothing."""
    ids = np.empty((_N, _K), np.int32)
    ids[:, 0] = 5 + rng.integers(0, 2, _N)
    ids[:, 1] = 3
    ids[:, 2] = 11 - ids[:, 0]  # the other one of 5 / 6
    return ids


@pytest.mark.parametrize(
    "impl",
    [moe_experts_ragged, moe_experts_blocked, moe_experts_skipping, moe_experts_dropless],
    ids=["ragged", "blocked", "skipping", "dispatch"],
)
@pytest.mark.parametrize(
    "make_ids, tokens",
    [(_random_ids, _N), (_skewed_ids, _N), (_random_ids, 2)],
    ids=["random", "skewed", "decode-sized"],
)
def test_dropless_matches_dense(impl, make_ids, tokens) -> None:
    """Every dropless form equals the dense reference; 2 tokens x 3 picks < 8 experts: one-row blocks."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((_N, _D)).astype(np.float32))[:tokens]
    w1, w2, w3 = _expert_weights(rng)
    ids_np = make_ids(rng)[:tokens]
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (_N, _K)).astype(np.float32))[:tokens]
    ids = jnp.asarray(ids_np)

    dropless = jax.jit(impl)(x, w1, w2, w3, weights, ids)
    dense = jax.jit(moe_experts_dense)(x, w1, w2, w3, weights, ids)
    ref = float64_experts(x, w1, w2, w3, weights, ids_np)
    assert dropless.shape == (tokens, _D) and dropless.dtype == jnp.float32
    assert _rel_err(dropless, dense) < EXPERTS_TOL2
    assert _rel_err(dense, ref) < EXPERTS_TOL
    assert _rel_err(dropless, ref) < EXPERTS_TOL


@pytest.mark.parametrize(
    "impl",
    [moe_experts_dense, moe_experts_ragged, moe_experts_blocked, moe_experts_skipping, moe_experts_dropless],
    ids=["dense", "ragged", "blocked", "skipping", "dispatch"],
)
@pytest.mark.parametrize("tokens", [4, 16, _N], ids=["slots", "stationary-limit", "prefill"])
def test_rows_not_valid_are_not_routed(impl, tokens) -> None:
    """Rows with `valid` False (idle slots, padding) give zeros; the valid rows equal the float64 loop over
    only the valid rows, whatever the idle rows chose (here: all of them expert 0)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((tokens, _D)).astype(np.float32))
    w1, w2, w3 = _expert_weights(rng)
    ids_np = _random_ids(rng)[:tokens]
    valid_np = rng.uniform(size=tokens) < 0.5
    valid_np[0], valid_np[-1] = True, False
    ids_np[~valid_np] = 0
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, _K)).astype(np.float32))
    out = np.asarray(jax.jit(impl)(x, w1, w2, w3, weights, jnp.asarray(ids_np), valid=jnp.asarray(valid_np)))
    assert np.all(out[~valid_np] == 0.0)
    v = np.flatnonzero(valid_np)
    ref = float64_experts(np.asarray(x)[v], w1, w2, w3, np.asarray(weights)[v], ids_np[v])
    assert _rel_err(out[v], ref) < EXPERTS_TOL


@pytest.mark.parametrize("tokens", [4, _N], ids=["one-row blocks", "blocks of 8 rows"])
def test_skipping_reads_only_the_experts_in_use(tokens) -> None:
    """An expert no valid row chose is never read: NaN weights in every other expert leave the result
    finite and equal to the reference (a path that touched them would turn NaN). The valid rows choose
    experts 1, 2 and 3 (40 tokens: 120 pairs, blocks of 8 rows, several per expert)."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((tokens, _D)).astype(np.float32))
    w1, w2, w3 = _expert_weights(rng)
    ids_np = np.zeros((tokens, _K), np.int32)
    ids_np[: tokens - 3] = [1, 2, 3]
    valid_np = np.arange(tokens) < tokens - 3
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, _K)).astype(np.float32))
    unused = np.ones(_E, bool)
    unused[[1, 2, 3]] = False
    poisoned = [jnp.where(unused[:, None, None], jnp.nan, w) for w in (w1, w2, w3)]
    ids, valid = jnp.asarray(ids_np), jnp.asarray(valid_np)
    out = np.asarray(jax.jit(moe_experts_skipping)(x, *poisoned, weights, ids, valid=valid))
    assert np.isfinite(out).all()
    v = np.flatnonzero(valid_np)
    ref = float64_experts(np.asarray(x)[v], w1, w2, w3, np.asarray(weights)[v], ids_np[v])
    assert _rel_err(out[v], ref) < EXPERTS_TOL


@pytest.mark.parametrize(
    "impl", [moe_experts_skipping_stacked, moe_experts_dropless_stacked], ids=["skipping", "dispatch"]
)
@pytest.mark.parametrize("tokens", [2, _N], ids=["decode-sized", "prefill"])
def test_stacked_experts_read_only_their_group(impl, tokens) -> None:
    """The scanned layers' form: experts stacked over 3 groups, group 1 chosen. It equals the float64 loop on
    group 1's weights, with NaN in the other groups and in group 1's unchosen experts (never read)."""
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((tokens, _D)).astype(np.float32))
    w1, w2, w3 = _expert_weights(rng)
    ids_np = _random_ids(rng)[:tokens]
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, _K)).astype(np.float32))
    unused = ~np.isin(np.arange(_E), ids_np)
    group = [jnp.where(unused[:, None, None], jnp.nan, w) for w in (w1, w2, w3)]
    stacked = [jnp.stack([jnp.full_like(w, jnp.nan), w, jnp.full_like(w, jnp.nan)]) for w in group]
    fn = jax.jit(lambda *a: impl(*a, group=jnp.int32(1)))
    out = np.asarray(fn(x, *stacked, weights, jnp.asarray(ids_np)))
    ref = float64_experts(x, w1, w2, w3, weights, ids_np)
    assert np.isfinite(out).all() and _rel_err(out, ref) < EXPERTS_TOL


def test_skipping_gradients_equal_the_dense_reference() -> None:
    """The loop's derivative (the block-sparse form's, taken in the backward pass) equals the dense
    reference's for x, every weight and the routing weights."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((_N, _D)).astype(np.float32))
    w1, w2, w3 = _expert_weights(rng)
    ids = jnp.asarray(_random_ids(rng))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (_N, _K)).astype(np.float32))
    probe = jnp.asarray(rng.standard_normal((_N, _D)).astype(np.float32))

    def loss(impl):
        return lambda *a: jnp.sum(probe * impl(*a, ids))

    got = jax.jit(jax.grad(loss(moe_experts_skipping), argnums=(0, 1, 2, 3, 4)))(x, w1, w2, w3, weights)
    want = jax.jit(jax.grad(loss(moe_experts_dense), argnums=(0, 1, 2, 3, 4)))(x, w1, w2, w3, weights)
    # the backward chains the forward's sums again, reversed; a weight's gradient also sums over the tokens
    bound = 2 * EXPERTS_TOL2 + float32_sums_bound(_N, sides=2)
    for g, w in zip(got, want, strict=True):
        assert _rel_err(g, w) < bound


def test_dropless_with_router_end_to_end_bf16() -> None:
    """Router output feeds the experts directly; bf16 activations/weights stay close to the reference."""
    rng = np.random.default_rng(3)
    x32 = rng.standard_normal((_N, _D)).astype(np.float32)
    gate = rng.standard_normal((_E, _D)).astype(np.float32)
    weights, ids = route(jnp.asarray(x32), jnp.asarray(gate), None, top_k=_K, n_group=4, topk_group=2)
    w1, w2, w3 = _expert_weights(rng, np.float32)
    x16 = jnp.asarray(x32, jnp.bfloat16)
    w16 = [a.astype(jnp.bfloat16) for a in (w1, w2, w3)]
    out = moe_experts_dropless(x16, *w16, weights, ids)
    assert out.dtype == jnp.bfloat16
    dense16 = moe_experts_dense(x16, *w16, weights, ids)
    ref32 = moe_experts_dense(jnp.asarray(x32), w1, w2, w3, weights, ids)
    assert _rel_err(out.astype(jnp.float32), dense16.astype(jnp.float32)) < 1e-2
    assert _rel_err(out.astype(jnp.float32), ref32) < 3e-2


# SiTU with caps small enough to bite on these activations (K3's are 4 and 25).
_SITU = GatedActivation("situ", beta=1.0, linear_beta=1.5)


@functools.cache
def _jitted_ragged(act: GatedActivation):
    return jax.jit(functools.partial(moe_experts_ragged, act=act))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    used=st.sampled_from((_E, 3, 1)),
    valid_share=st.sampled_from((1.0, 0.5, 0.0)),
    act=st.sampled_from((SILU, _SITU)),
)
def test_ragged_grouped_matmul_equals_the_float64_loop(seed, used, valid_share, act) -> None:
    """`jax.lax.ragged_dot` runs on XLA:CPU, so the accelerators' grouped path is tested here: ids drawn with
    repeats (a token may pick one expert twice) from `used` of the experts (the rest get empty groups), rows
    not valid (some, or all) sort past every group and come back zero."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((_N, _D)).astype(np.float32))
    w1, w2, w3 = _expert_weights(rng)
    chosen = rng.permutation(_E)[:used]
    ids = chosen[rng.integers(0, used, (_N, _K))].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (_N, _K)).astype(np.float32)
    valid = rng.uniform(size=_N) < valid_share
    out = np.asarray(_jitted_ragged(act)(x, w1, w2, w3, jnp.asarray(weights), jnp.asarray(ids), valid=valid))
    ref = float64_experts(x, w1, w2, w3, weights, ids, valid, act)
    assert np.all(out[~valid] == 0.0)
    if valid.any():
        assert _rel_err(out[valid], ref[valid]) < EXPERTS_TOL

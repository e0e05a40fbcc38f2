"""MXFP4 routed experts kept packed, at the ops level: every expert implementation given `MXFP4` weights
equals a float64 loop over the weights dequantized by the NumPy reference (`weights.mxfp4`), and the paths
that promise to read only the experts in use never dequantize another one (a NaN scale there stays out)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_sums_bound

from jaxhybrid.ops import int8
from jaxhybrid.ops.moe import (
    moe_experts_blocked,
    moe_experts_dense,
    moe_experts_dropless,
    moe_experts_dropless_stacked,
    moe_experts_ragged,
    moe_experts_skipping,
    moe_experts_skipping_stacked,
)
from jaxhybrid.ops.mxfp4 import MXFP4, SCALE_NAN
from jaxhybrid.weights.mxfp4 import dequantize_mxfp4

_N, _D, _F, _E, _K = 24, 64, 96, 8, 3
# MXFP4 dequantizes exactly (an E2M1 code times a power of two is a float32), so only the experts' chain of
# float32 sums errs: gate and up over _D, the activation, down over _F, the weighted sum over the _K picks.
TOL = float32_sums_bound(_D, ACTIVATION_ROUNDINGS, _F, _K)
IMPLS = [
    moe_experts_dense,
    moe_experts_ragged,
    moe_experts_blocked,
    moe_experts_skipping,
    moe_experts_dropless,
]
IMPL_IDS = ["dense", "ragged", "blocked", "skipping", "dispatch"]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def packed_weights(rng: np.random.Generator, lead: tuple[int, ...] = (_E,)) -> tuple[MXFP4, ...]:
    """Random codes and scales around 2^-4 (weights of about 0.1), for w1, w2, w3."""

    def one(out: int, cols: int) -> MXFP4:
        packed = rng.integers(0, 256, (*lead, out, cols // 2), dtype=np.uint8)
        scale = rng.integers(122, 126, (*lead, out, cols // 32), dtype=np.uint8)
        return MXFP4(jnp.asarray(packed), jnp.asarray(scale))

    return one(_F, _D), one(_D, _F), one(_F, _D)


def dense64(w: MXFP4) -> np.ndarray:
    return dequantize_mxfp4(np.asarray(w.packed), np.asarray(w.scale), np.float64)


def loop64(x, ws, weights, ids) -> np.ndarray:
    """Float64 per-token loop over the chosen experts (SiLU gate)."""
    w1, w2, w3 = (dense64(w) for w in ws)
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids)[n]):
            g = w1[e] @ x[n]
            out[n] += weights[n, j] * (w2[e] @ (g / (1.0 + np.exp(-g)) * (w3[e] @ x[n])))
    return out


def inputs(rng: np.random.Generator, tokens: int):
    x = jnp.asarray(rng.standard_normal((tokens, _D)).astype(np.float32))
    ids = np.stack([rng.permutation(_E)[:_K] for _ in range(tokens)]).astype(np.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, _K)).astype(np.float32))
    return x, ids, weights


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("tokens", [2, _N], ids=["decode-sized", "prefill"])
def test_packed_experts_match_float64_reference(impl, tokens) -> None:
    """Packed weights through each implementation (fp32) vs the float64 loop on the reference-dequantized
    weights: within the experts' float32 bound (TOL); rows not valid give zeros."""
    rng = np.random.default_rng(tokens)
    x, ids, weights = inputs(rng, tokens)
    ws = packed_weights(rng)
    valid = np.ones(tokens, bool)
    valid[-1] = False
    out = np.asarray(jax.jit(impl)(x, *ws, weights, jnp.asarray(ids), valid=jnp.asarray(valid)))
    assert out.shape == (tokens, _D) and out.dtype == np.float32
    assert np.all(out[~valid] == 0.0)
    ref = loop64(np.asarray(x)[valid], ws, np.asarray(weights)[valid], ids[valid])
    assert rel_err(out[valid], ref) < TOL


def poison_unused(ws: tuple[MXFP4, ...], used: np.ndarray) -> tuple[MXFP4, ...]:
    """The experts not in `used` get the E8M0 NaN scale: dequantizing any of them makes NaN weights."""
    unused = ~np.isin(np.arange(_E), used)
    lead = (slice(None),) * (ws[0].scale.ndim - 3)
    out = []
    for w in ws:
        scale = np.array(w.scale)
        scale[(*lead, unused)] = SCALE_NAN
        out.append(MXFP4(w.packed, jnp.asarray(scale)))
    return tuple(out)


@pytest.mark.parametrize(
    "impl",
    [moe_experts_ragged, moe_experts_skipping, moe_experts_blocked],
    ids=["ragged", "skipping", "blocked"],
)
def test_packed_paths_dequantize_only_the_experts_in_use(impl) -> None:
    """Three tokens choose experts {1, 2, 4, 6}; every other expert has NaN scales. The result is finite
    and equals the reference: no whole-layer dequantized copy was made (it would hold NaN)."""
    rng = np.random.default_rng(5)
    x, _, weights = inputs(rng, 3)
    ids = np.array([[1, 2, 4], [4, 6, 1], [2, 1, 6]], np.int32)
    ws = packed_weights(rng)
    out = np.asarray(jax.jit(impl)(x, *poison_unused(ws, ids), weights, jnp.asarray(ids)))
    assert np.isfinite(out).all()
    assert rel_err(out, loop64(x, ws, weights, ids)) < TOL


@pytest.mark.parametrize(
    "impl", [moe_experts_skipping_stacked, moe_experts_dropless_stacked], ids=["skipping", "dispatch"]
)
def test_packed_stacked_experts_read_only_their_group(impl) -> None:
    """Scanned layers' form with packed experts stacked over 3 groups, group 1 chosen; the other groups and
    group 1's unchosen experts have NaN scales."""
    rng = np.random.default_rng(11)
    x, ids, weights = inputs(rng, 2)
    stacked = packed_weights(rng, lead=(3, _E))
    poisoned = poison_unused(stacked, ids)
    ws = tuple(
        MXFP4(w.packed, w.scale.at[jnp.asarray([0, 2])].set(SCALE_NAN).at[1].set(p.scale[1]))
        for w, p in zip(stacked, poisoned, strict=True)
    )
    out = np.asarray(jax.jit(lambda *a: impl(*a, group=jnp.int32(1)))(x, *ws, weights, jnp.asarray(ids)))
    group1 = tuple(MXFP4(w.packed[1], w.scale[1]) for w in stacked)
    assert np.isfinite(out).all() and rel_err(out, loop64(x, group1, weights, ids)) < TOL


def test_mixed_packed_and_dense_weights_are_refused() -> None:
    rng = np.random.default_rng(0)
    x, ids, weights = inputs(rng, 2)
    w1, w2, w3 = packed_weights(rng)
    with pytest.raises(ValueError, match="all MXFP4, all int8 or all dense"):
        moe_experts_dense(x, w1, jnp.zeros(w2.shape), w3, weights, jnp.asarray(ids))
    q1, q2, q3 = (int8.quantize(jnp.zeros(w.shape)) for w in (w1, w2, w3))
    with pytest.raises(ValueError, match="all MXFP4, all int8 or all dense"):
        moe_experts_dense(x, q1, w2, q3, weights, jnp.asarray(ids))

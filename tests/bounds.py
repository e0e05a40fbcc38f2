"""How far a float32 evaluation of a product may be from the exact one: bounds derived from the arithmetic,
for tolerances that hold on any CPU (any vector width, any order or blocking of the sums)."""

from __future__ import annotations

import numpy as np

U = 2.0**-24  # float32's unit roundoff


def float32_product_bound(x, w, extra_roundings: int = 0) -> np.ndarray:
    """Elementwise bound on |fl(x @ w.T) - x @ w.T| for x [.., K], w [N, K] evaluated in float32: gamma(K) =
    K u / (1 - K u) times the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1), for any order and blocking of the sums; `extra_roundings` more float32 roundings of
    each term (a weight's scale applied per term, or to the sum) add theirs."""
    k = np.asarray(x).shape[-1] + extra_roundings
    gamma = k * U / (1 - k * U)
    return gamma * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T)


def assert_within(got, want, bound) -> None:
    """|got - want| <= bound, elementwise, with the worst case named when it fails."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    bad = err > bound
    assert not bad.any(), (
        f"{bad.sum()} of {err.size} off: {err[bad].max():.3g} against a bound of {bound[bad].min():.3g}"
    )

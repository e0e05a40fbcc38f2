"""How far a float32 evaluation may be from the exact one (or from another float32 evaluation): bounds
derived from the arithmetic, for tolerances that hold on any CPU (Intel or AMD, with or without AVX-512,
native kernels or XLA's formulations: any vector width, any order or blocking of the sums). Every tolerance
of the suite's float32 comparisons comes from here (or states its own derivation beside it); none is a
figure measured on one machine. docs/testing.md says how they are used.

The unit: a float32 sum of K terms, in any order, errs by at most gamma(K) = K u / (1 - K u) times the sum
of its terms' magnitudes (u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms, 3.1).
- `float32_product_bound`: that bound for a matrix product, elementwise, from |x| |w| (rigorous).
- `float32_sums_bound`: a chain of sums, relative to the output's magnitude (first order).
- `float32_network_bound`: a whole model (L layers of SUMS_PER_LAYER sums of its widest K), relative to the
  largest logit (first order).
- `float32_log_softmax_bound`: a log-softmax, elementwise and absolute.
`sides` 1 against a float64 oracle, 2 between two float32 evaluations (either may err). Where a step
amplifies its inputs' error (a softmax turns its logits' absolute error into relative error), the test adds
that gain from its own inputs (tests/test_ops_mla.py `mla_tol`, test_ops_moe.py `route_tol`)."""

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


# An activation's or a gate's elementwise steps, counted as roundings: SiTU, the longest, has 8 arithmetic
# roundings (scalings, a divide, products) and 3 transcendental functions (two tanh caps, the sigmoid's exp),
# counted at 8 ulps each (XLA:CPU's polynomial approximations are within a few): 32. Each function's
# condition number is at most 1 where the output is near its largest (|z tanh'(z) / tanh(z)| <= 1,
# z sigmoid'(z) / sigmoid(z) = z (1 - sigmoid(z)) < 1.3), so no argument's rounding is amplified.
ACTIVATION_ROUNDINGS = 32


def gamma(k: int) -> float:
    """gamma(K) = K u / (1 - K u): a float32 sum of K terms (or K chained roundings) errs by at most
    gamma(K) times the sum of the terms' magnitudes, in any order and blocking (Higham, 3.1)."""
    return k * U / (1 - k * U)


def float32_sums_bound(*lengths: int, sides: int = 1) -> float:
    """Relative bound (to the output's magnitude) of a float32 evaluation that chains sums of the given
    lengths, each a step of the computation (a product's K terms, a softmax's row, a layer's few elementwise
    roundings counted as terms): to first order the errors that a step passes on add, so sum(gamma(K_i)).
    `sides` = 1 against a float64 oracle, 2 between two float32 evaluations (either may err). Used with
    `rel_err` (max|a - b| / max|b|): it takes the terms' magnitudes to be of the order of the largest output,
    as for the tests' random inputs (a sum of K normal terms has magnitudes sum ~ sqrt(K) times its size,
    its rounding errors a random walk ~ sqrt(K) u: the worst case K u leaves that factor to spare).
    Derived from the computation's shape, not measured: any CPU, vector width or summation order lands
    inside; a wrong index, weight or mask is off by percents."""
    return sides * sum(gamma(k) for k in lengths)


# The sums a layer chains on its longest path, each of at most the model's widest K terms: its two norms
# (a mean of squares over the hidden width each), the attention's input projections (two with a low-rank
# step), the scores (a softmax passes its logits' absolute error on as relative error: counted as a sum),
# the mix over tokens (an attention row or a KDA state), the output projection, the router, the experts' two
# products and the sum over the picked experts. Elementwise steps (activations, gates, residual adds) add a
# few roundings each, well inside one sum of K terms.
SUMS_PER_LAYER = 10


def float32_network_bound(cfg, tokens: int, sides: int = 2, layers: int | None = None) -> float:
    """How far a float32 evaluation of a whole model may be from another (sides 2: another summation order,
    another kernel) or from the float64 reference (sides 1), relative to its largest logit: each of the L
    layers chains SUMS_PER_LAYER sums, each rounding within gamma(K) of its terms' magnitudes (K the longest
    sum of the model: its widest projection, or the `tokens` a KDA state and an attention row sum over), and
    to first order the errors passed on add up the residual stream: sides * L * SUMS_PER_LAYER * gamma(K)
    (tiny, K 128: 3.1e-4 a side). Nothing here is measured: a CPU with other vector widths sums in another
    order and still lands inside; a wrong weight, mask or route is off by percents. `layers`: that many of
    the model's layers (1: one module of a layer against the reference), default all of them."""
    widths = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.moe_intermediate_size,
        cfg.num_attention_heads * cfg.v_head_dim,  # MLA's output projection
        cfg.kda_num_heads * cfg.kda_head_dim,  # KDA's output projection
        cfg.kv_lora_rank,
        cfg.q_lora_rank or 0,
        cfg.routed_expert_hidden_size or 0,
        tokens,
    )
    layers = cfg.num_hidden_layers if layers is None else layers
    return sides * layers * SUMS_PER_LAYER * gamma(max(widths))


def float32_log_softmax_bound(logits, sides: int = 1) -> np.ndarray:
    """Elementwise absolute bound on a float32 log-softmax of `logits` (rows over the last axis; pass them
    after any temperature, whose divide adds a rounding of each): x - max rounds within u |x - max| (and
    the divide, if any, within u |x|), the sum of the V exponentials (positive terms, each within a few
    ulps) within gamma(V + ACTIVATION_ROUNDINGS) relative, which the log turns absolute, and the last
    subtraction within u of the result: 3 u (|x - max| + |x|) + gamma(V + ACTIVATION_ROUNDINGS) per side."""
    x = np.asarray(logits, np.float64)
    gap = x.max(-1, keepdims=True) - x
    return sides * (3 * U * (gap + np.abs(x)) + gamma(x.shape[-1] + ACTIVATION_ROUNDINGS))

"""Oracles the engine and model tests share: a model's full causal pass as the reference for what the engine
serves (tokens and per-token logprobs), and weights made non-default so that a dropped weight shows against
the float64 NumPy reference (tests/numpy_reference.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from numpy_reference import NumpyReference

from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import HybridLM, pure_fn
from jaxhybrid.weights.hf import named_arrays

# Per-token logprobs of what the engine serves vs the full pass (absolute, fp32 logprobs of about -4 to -7):
# the engine computes the same positions with other fp32 evaluation orders (chunked vs recurrent KDA,
# absorbed vs expanded MLA, chunks of another length), measured up to about 2e-5.
LOGPROB_TOL = 5e-5


class FullPass:
    """Logits [T, vocab] float64 of the full causal pass over one token list, right-padded to a multiple of
    `pad` so that a few compiled programs serve every length (padding after the last token changes none of the
    logits before it: the pass is causal)."""

    def __init__(self, model: HybridLM, pad: int = 64):
        self.fn, self.state = pure_fn(model)
        self.pad = pad
        self.model = model
        self._exact: NumpyReference | None = None

    def exact(self, toks) -> np.ndarray:
        """The same logits from the float64 NumPy reference: where two fp32 programs part, what is right."""
        if self._exact is None:
            self._exact = NumpyReference(self.model.config, named_arrays(self.model))
        return self._exact.forward(np.asarray(toks))

    def __call__(self, toks, pad: int | None = None) -> np.ndarray:
        pad = pad or self.pad
        padded = np.zeros((1, -(-len(toks) // pad) * pad), np.int32)
        padded[0, : len(toks)] = toks
        return np.asarray(self.fn(self.state, jnp.asarray(padded))[0, : len(toks)], np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def assert_matches_full_pass(
    full: Callable[[list[int]], np.ndarray], prompt, generated, logprobs=None, tol: float = LOGPROB_TOL
):
    """Every greedy token is the argmax of the full pass over everything before it (or, at a near-tie, within
    `tol` of its largest logit: two fp32 evaluation orders may decide a tie either way; seen: 2.4e-7 apart),
    and (when given) its logprob equals that pass's log-softmax within `tol`. `full`: tokens -> logits
    [T, vocab] (a FullPass).

    Where a logprob is further off, the full pass runs again at two other padded lengths (other fp32
    evaluation orders): a position where the passes themselves differ (seen on an Intel VM: by 1.2e-4 at one
    position of tiny, padded to 32 or 64) allows twice that difference on top of `tol`. And there the float64
    NumPy reference decides: a logprob within `tol` of the exact one passes (seen: one position of tiny where
    the fp32 full pass is 2.1e-5 from exact and the engine's decode products, in another summation order,
    land 6.3e-5 from the pass but 1.5e-5 from exact), and so does one within `tol` plus twice the fp32 full
    pass's own distance from exact, which measures how ill-conditioned the position is (seen: a resumed
    prefill 4.0e-4 from exact where the full pass is 2.3e-4 from it and its other paddings agree with it
    within 1.5e-4). Elsewhere `tol` against the full pass stands."""
    seq = list(prompt) + list(generated)
    logits = full(seq[:-1])[len(prompt) - 1 :]
    rows = np.arange(len(generated))
    short = logits.max(-1) - logits[rows, generated]  # 0 where the token is the argmax
    assert np.all(short <= tol), f"{generated} against the full pass's {list(logits.argmax(-1))}: {short}"
    if logprobs is None:
        return
    want = log_softmax(logits)[rows, generated]
    off = np.abs(np.asarray(logprobs) - want)
    allowed = np.full(len(generated), tol)
    if np.any(off > tol) and isinstance(full, FullPass):
        for pad in (2 * full.pad, max(full.pad // 2, 1)):
            again = log_softmax(full(seq[:-1], pad=pad)[len(prompt) - 1 :])[rows, generated]
            allowed = np.maximum(allowed, tol + 2 * np.abs(again - want))
        if np.any(off > allowed):
            exact = log_softmax(full.exact(seq[:-1])[len(prompt) - 1 :])[rows, generated]
            # the fp32 full pass's own distance from exact measures how ill-conditioned a position is: another
            # fp32 evaluation order may land as far on the other side
            near = tol + 2 * np.abs(want - exact)
            off = np.where(np.abs(np.asarray(logprobs) - exact) <= near, 0.0, off)
    assert np.all(off <= allowed), f"logprobs off by {off.max():.3g} at {off.argmax()} (allowed {allowed})"


def assert_same_greedy_tokens(
    full: Callable[[list[int]], np.ndarray], prompt, got, want, tol: float = LOGPROB_TOL
) -> None:
    """Two greedy continuations of `prompt` computed by different programs are the same tokens, except where
    they part at a near-tie: the full pass there puts both tokens within `tol` of its largest logit, which
    two fp32 evaluation orders may decide either way (seen: two logits 1.2e-6 apart). After such a
    position nothing more is compared (the sequences then continue from different tokens)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            logits = full(list(prompt) + list(want[:i]))[-1]
            gap = logits.max() - logits[[a, b]]
            assert gap.max() <= tol, f"token {i}: {a} against {b}, {gap} under the full pass's best: no tie"
            return


def assert_same_arrays(got: HybridLM, want: HybridLM) -> list[str]:
    """Both models hold the same named arrays, dtypes and bits (with one config: the same logits); returns
    the names compared."""
    got_arrays, want_arrays = named_arrays(got), named_arrays(want)
    assert got_arrays.keys() == want_arrays.keys()
    for name, arr in got_arrays.items():
        assert arr.dtype == want_arrays[name].dtype, name
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want_arrays[name]), err_msg=name)
    return list(got_arrays)


def randomize(module: nnx.Module, seed: int) -> dict[str, np.ndarray]:
    """Give norms, biases, the router bias and A_log non-default values (so a dropped weight shows) and put
    garbage in A_log's padding (so using it shows). Returns the state as name -> array for the reference."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Any(nnx.Param, Buffer))
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        value = np.asarray(var.get_value())
        if name.endswith("norm.weight"):
            value = 1.0 + 0.3 * rng.uniform(-1, 1, value.shape)
        elif name.endswith(("dt_bias", "e_score_correction_bias")):
            value = rng.uniform(-0.5, 0.5, value.shape) * (0.1 if "score" in name else 1.0)
        elif name.endswith("A_log"):
            flat = value.reshape(-1).copy()
            heads = module.config.kda_num_heads if hasattr(module, "config") else module.num_heads
            if flat.size > heads:
                flat[heads:] = 7.0  # padding: K3 stores zeros here; any value must be ignored
            else:
                flat = rng.uniform(-1.0, 1.0, flat.shape)  # one entry per head: non-default rates
            value = flat.reshape(value.shape)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
    nnx.update(module, state)
    return {
        ".".join(str(p) for p in path): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(module, nnx.Any(nnx.Param, Buffer)))
    }

"""Oracles the engine and model tests share: a model's full causal pass as the reference for what the engine
serves (tokens and per-token logprobs), and weights made non-default so that a dropped weight shows against
the float64 NumPy reference (tests/numpy_reference.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from bounds import float32_log_softmax_bound, float32_network_bound
from flax import nnx
from numpy_reference import NumpyReference

from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import HybridLM, pure_fn
from jaxhybrid.weights.hf import named_arrays


def logprob_bounds(cfg, logits: np.ndarray, tokens, length: int) -> tuple[np.ndarray, np.ndarray]:
    """What the engine serves against the full pass: the same positions computed in other fp32 evaluation
    orders (chunked vs recurrent KDA, absorbed vs expanded MLA, chunks of another length), so their logits
    differ by at most `bounds.float32_network_bound(cfg, length)` (two sides) times the largest |logit|.
    Returns, per row of `logits` [rows, vocab] and its `tokens`: how far a greedy token's logit may fall
    short of the largest one (a tie within that may go either way: twice the logits' bound), and how far
    its logprob may be (a log-softmax moves by at most twice its inputs' largest error, plus its own
    roundings, two sides). Derived from the model's shape, not measured on one CPU."""
    logits = np.asarray(logits, np.float64)
    rows = np.arange(len(logits))
    err = float32_network_bound(cfg, length) * np.abs(logits).max()
    tie = np.full(len(logits), 2 * err)
    return tie, 2 * err + float32_log_softmax_bound(logits, sides=2)[rows, np.asarray(tokens)]


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
    full: Callable[[list[int]], np.ndarray], prompt, generated, logprobs=None, config=None
):
    """Every greedy token is the argmax of the full pass over everything before it (or, at a near-tie, within
    the logits' bound of its largest logit: two fp32 evaluation orders may decide a tie either way; seen:
    2.4e-7 apart), and (when given) its logprob equals that pass's log-softmax within the logprobs' bound
    (`logprob_bounds`). `full`: tokens -> logits [T, vocab] (a FullPass; another callable names the model's
    `config`).

    Where a logprob is further off, the full pass runs again at two other padded lengths (other fp32
    evaluation orders): a position where the passes themselves differ allows twice that difference on top
    of the bound. And there the float64 NumPy reference decides: a logprob within the bound of the exact one
    passes, and so does one within it plus twice the fp32 full pass's own distance from exact, which
    measures how ill-conditioned the position is. Elsewhere the bound against the full pass stands."""
    seq = list(prompt) + list(generated)
    logits = full(seq[:-1])[len(prompt) - 1 :]
    rows = np.arange(len(generated))
    tie, tol = logprob_bounds(full.model.config if config is None else config, logits, generated, len(seq))
    short = logits.max(-1) - logits[rows, generated]  # 0 where the token is the argmax
    assert np.all(short <= tie), f"{generated} against the full pass's {list(logits.argmax(-1))}: {short}"
    if logprobs is None:
        return
    want = log_softmax(logits)[rows, generated]
    off = np.abs(np.asarray(logprobs) - want)
    allowed = tol.copy()
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


def assert_same_greedy_tokens(full: FullPass, prompt, got, want) -> None:
    """Two greedy continuations of `prompt` computed by different programs are the same tokens, except where
    they part at a near-tie: the full pass there puts both tokens within the logits' bound (`logprob_bounds`)
    of its largest logit, which two fp32 evaluation orders may decide either way (seen: two logits 1.2e-6
    apart). After such a position nothing more is compared (the sequences then continue from different
    tokens)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            logits = full(list(prompt) + list(want[:i]))
            tie, _ = logprob_bounds(full.model.config, logits, np.zeros(len(logits), int), len(logits))
            gap = logits[-1].max() - logits[-1][[a, b]]
            assert gap.max() <= tie[-1], f"token {i}: {a} against {b}, {gap} under the full pass's best"
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

"""The shared oracle itself (tests/oracles.py): it accepts the full pass's own greedy tokens and logprobs and
rejects a logprob moved by a few tolerances, even after its fall-backs (other paddings, float64)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import FullPass, assert_matches_full_pass, log_softmax, logprob_bounds

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM


def test_the_full_pass_oracle_accepts_itself_and_rejects_a_moved_logprob():
    full = FullPass(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32), pad=32)
    seq = np.random.default_rng(0).integers(3, 500, 6).tolist()
    logprobs = []
    for _ in range(5):  # greedy continuation by the full pass
        lp = log_softmax(full(seq)[-1])
        seq.append(int(lp.argmax()))
        logprobs.append(float(lp.max()))
    prompt, generated = seq[:6], seq[6:]
    assert_matches_full_pass(full, prompt, generated, logprobs)
    # the float64 reference agrees with the fp32 pass here, so it cannot rescue a wrong value
    exact = log_softmax(full.exact(seq[:-1])[5:])[np.arange(5), generated]
    _, tol = logprob_bounds(full.model.config, full(seq[:-1])[5:], generated, len(seq))
    assert np.all(np.abs(exact - np.asarray(logprobs)) < tol / 5)
    moved = list(logprobs)
    moved[2] += 4 * tol[2]
    with pytest.raises(AssertionError, match="logprobs off"):
        assert_matches_full_pass(full, prompt, generated, moved)

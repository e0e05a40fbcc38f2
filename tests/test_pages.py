"""Weights in 2 MB pages (`jaxhybrid.weights.pages`): the same values at a 2 MB boundary, read in place by
XLA, each large weight moved once; an engine serving from them equals one serving the same weights from
XLA's own buffers, bit for bit."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights import pages
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)


def wide_tiny() -> HybridLM:
    """`tiny` with a vocabulary wide enough that its embedding and lm_head are one huge page each
    (8192 x 64 float32 = 2 MB); every other weight is smaller."""
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=8192)
    return HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_an_array_in_huge_pages_keeps_its_values_at_a_boundary(dtype):
    host = (np.random.default_rng(0).standard_normal((777, 1031)) * 50).astype(dtype)  # 3.2 / 0.8 MB
    x = jnp.asarray(host)
    y = pages.in_huge_pages(x)
    assert y.unsafe_buffer_pointer() % pages.PAGE == 0  # XLA reads the mapping in place: no copy of it
    assert y.dtype == x.dtype and y.shape == x.shape and y.sharding == x.sharding
    del x
    gc.collect()  # nothing but the array holds its mapping
    np.testing.assert_array_equal(np.asarray(y), host)
    np.testing.assert_array_equal(np.asarray(y * 2), host * 2)


def test_which_arrays_qualify():
    big = jnp.zeros((pages.PAGE // 4,), jnp.float32)
    assert pages.qualifies(big)
    assert not pages.qualifies(jnp.zeros((pages.PAGE // 4 - 1,), jnp.float32))  # under a page
    assert not pages.qualifies(np.zeros((pages.PAGE,), np.uint8))  # not a jax array
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    spread = jax.device_put(big, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    assert not pages.qualifies(spread)  # on two devices
    assert not pages.qualifies(pages.in_huge_pages(big))  # already moved


def test_each_large_weight_moves_once(monkeypatch):
    monkeypatch.setattr(pages, "available", lambda: True)  # whatever this machine's kernel offers
    model = wide_tiny()
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}
    want = sum(a.nbytes for a in before.values() if a.nbytes >= pages.PAGE)
    assert want == 2 * 8192 * 64 * 4  # the embedding and lm_head, by hand
    assert pages.move_to_huge_pages(model) == want
    assert pages.move_to_huge_pages(model) == 0  # a second engine on the same model moves nothing
    after = dict(nnx.to_flat_state(nnx.state(model)))
    for key, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[key]), value)
    assert model.lm_head.weight[...].unsafe_buffer_pointer() % pages.PAGE == 0


def test_turned_off_it_moves_nothing(monkeypatch):
    monkeypatch.setenv("JAXHYBRID_HUGE_PAGES", "0")
    assert not pages.available()
    assert pages.move_to_huge_pages(wide_tiny()) == 0


def test_an_engine_on_moved_weights_equals_one_on_xla_buffers(monkeypatch):
    prompts = [[5, 900, 17, 8000, 3], list(range(40, 71))]

    def run(model):
        engine = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=16))
        results = [engine.result(r) for r in [engine.add_request(p, GREEDY) for p in prompts]]
        while engine.has_unfinished():
            engine.step()
        return [(r.token_ids, r.logprobs) for r in results]

    monkeypatch.setattr(pages, "available", lambda: True)
    moved = wide_tiny()
    assert pages.move_to_huge_pages(moved) > 0
    monkeypatch.setattr(pages, "available", lambda: False)
    assert run(moved) == run(wide_tiny())  # same seed, weights left where XLA put them


def test_an_engine_leaves_its_callers_model_as_it_was(monkeypatch):
    """Moving the weights is the loader's (`serve.models`), not the engine's: an engine built on a model
    takes its arrays as they are and replaces none of them."""
    monkeypatch.setattr(pages, "available", lambda: True)
    model = wide_tiny()
    before = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    Engine(model, EngineConfig(max_slots=1, block_size=8, prefill_chunk=16))
    after = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    assert all(after[k] is before[k] for k in before)

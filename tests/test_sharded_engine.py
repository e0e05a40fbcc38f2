"""The engine on a device mesh (8 simulated CPU devices): the greedy tokens and per-token logprobs of the
unsharded model's full causal pass; pools and expert weights really sharded."""

import jax
import numpy as np
import pytest
from flax import nnx
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from sharding.mesh import mesh_from_flag
from sharding.placement import shard_model

ENGINE = EngineConfig(max_slots=8, block_size=8, prefill_chunk=32, max_model_len=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 512, n).tolist() for n in (5, 40, 17, 33)]


@pytest.fixture(scope="module")
def unsharded_full_pass():
    return FullPass(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(
    "spec",
    [
        # every axis at once in the default run; each axis alone (tensor, expert, data) with -m slow
        pytest.param("data=1,expert=1,tensor=8", marks=pytest.mark.slow),
        pytest.param("data=1,expert=8,tensor=1", marks=pytest.mark.slow),
        "data=2,expert=2,tensor=2",
        pytest.param("data=8,expert=1,tensor=1", marks=pytest.mark.slow),
    ],
)
def test_sharded_engine_gives_the_unsharded_tokens_and_logprobs(spec, unsharded_full_pass):
    assert len(jax.devices()) == 8
    mesh = mesh_from_flag(spec)
    model = shard_model(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)), mesh)
    eng = Engine(model, ENGINE, mesh=mesh)
    for prompt, res in zip(prompts(), eng.generate(prompts(), GREEDY), strict=True):
        assert_matches_full_pass(unsharded_full_pass, prompt, res.token_ids, res.logprobs)
    # the pools stay in their shardings through the donated program
    for pool, want in zip(eng.runner.pools, eng.runner.pool_shardings, strict=True):
        for leaf, sharding in zip(jax.tree.leaves(pool), jax.tree.leaves(want), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    state = eng.runner.pools[0].state  # [slots, heads, d, d]
    shard_rows = state.addressable_shards[0].data.shape[0]
    assert shard_rows == 8 // (mesh.shape["data"] * mesh.shape["expert"])  # slots split over data x expert
    experts = model.model.layers[1].block_sparse_moe.experts.w1[
        ...
    ]  # [E=8, F=32, D]: E on expert, F on tensor
    per_device = experts.addressable_shards[0].data.nbytes
    assert per_device == experts.nbytes // (mesh.shape["expert"] * mesh.shape["tensor"])

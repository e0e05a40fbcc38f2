"""MXFP4 experts kept packed on a mesh (8 simulated CPU devices): the `expert` axis shards codes and
scales, the `tensor` axis splits them only together and only on whole scale groups, and a sharded packed
model (loaded straight into its shardings, expert parallelism where the expert axis divides) equals the
unsharded dequantized one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err
from flax import nnx
from jax.sharding import PartitionSpec

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, abstract_model
from jaxhybrid.weights import load_pretrained, save_hf
from sharding.mesh import make_mesh
from sharding.placement import load_pretrained_on_mesh, shard_model
from sharding.rules import batch_sharding, partition_specs

# tiny cut to two layers (KDA + dense MLP, then MLA + MoE) with MXFP4 experts of width 64 (2 scale groups)
CFG = load_config("tiny").replace(
    num_hidden_layers=2,
    kda_layers=(1,),
    full_attn_layers=(2,),
    moe_intermediate_size=64,
    expert_quant="mxfp4",
)
TOKENS = np.random.default_rng(1).integers(0, CFG.vocab_size, (4, 16), dtype=np.int32)
# as tests/test_sharded_model.py: sharded programs sum in other orders (psum over tensor), within two float32
# evaluations of the model (`bounds.float32_network_bound`)
TOL = float32_network_bound(CFG, TOKENS.shape[1])
PACKED = ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the checkpoint of a random packed model, the unsharded dequantized model's logits)."""
    path = tmp_path_factory.mktemp("packed")
    save_hf(HybridLM(CFG, rngs=nnx.Rngs(0)), path)
    dense = load_pretrained(path, dequantize_experts=True)
    graphdef, state = nnx.split(dense)
    return path, np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, TOKENS))


def expert_specs(model, mesh) -> dict[str, PartitionSpec]:
    specs = partition_specs(model, mesh)
    ex = specs["model"]["layers"][1]["block_sparse_moe"]["experts"]
    return {n: ex[n].get_value() for n in PACKED}


@pytest.mark.parametrize(
    "spec, up, down, expert_parallel",
    [
        ("data=2,expert=2,tensor=2", ("expert", "tensor"), ("expert", None, "tensor"), True),
        ("expert=8", ("expert",), ("expert",), True),
        # F = 64 is 2 scale groups: 4 tensor ranks cannot split them (a dense w1 of F = 64 would be split)
        ("data=2,tensor=4", (), (), False),
    ],
)
def test_sharded_packed_model_equals_unsharded_dequantized(checkpoint, spec, up, down, expert_parallel):
    path, want = checkpoint
    mesh = make_mesh(spec)
    model = shard_model(load_pretrained_on_mesh(path, mesh), mesh)  # read into shardings, EP installed
    assert model.packed_experts
    assert (model.model.layers[1].block_sparse_moe.experts_fn is not None) == expert_parallel
    specs = expert_specs(model, mesh)
    ex = model.model.layers[1].block_sparse_moe.experts
    for name in PACKED:
        want_spec = PartitionSpec(*(down if name.startswith("w2") else up))
        assert specs[name] == want_spec, name
        assert getattr(ex, name)[...].sharding.spec == want_spec, name
    graphdef, state = nnx.split(model)
    tokens = jax.device_put(TOKENS, batch_sharding(mesh, TOKENS.shape))
    got = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))
    assert rel_err(got, want) < TOL


def test_tensor_split_of_w2_needs_whole_scale_groups():
    """F = 96 (3 scale groups) on tensor=2: the dense w2's F splits (96 / 2), the packed w2's codes (48 / 2)
    would, its scales (3 / 2) cannot: neither codes nor scales split, and w1 / w3 keep F whole too."""
    mesh = make_mesh("tensor=2", devices=jax.devices()[:2])
    cfg = CFG.replace(moe_intermediate_size=96)
    packed = expert_specs(abstract_model(cfg), mesh)
    assert all(spec == PartitionSpec() for spec in packed.values()), packed
    dense = partition_specs(abstract_model(cfg, dequantize_experts=True), mesh)
    dense_ex = dense["model"]["layers"][1]["block_sparse_moe"]["experts"]
    assert dense_ex["w2"].get_value() == PartitionSpec(None, None, "tensor")
    assert jnp.dtype(abstract_model(cfg).model.layers[1].block_sparse_moe.experts.w2_scale.dtype) == jnp.uint8

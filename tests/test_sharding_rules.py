"""sharding.mesh (spec parsing, mesh construction) and sharding.rules (logical names -> shardings)."""

import argparse

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from sharding.mesh import (
    MeshSpecError,
    add_mesh_argument,
    make_mesh,
    mesh_from_flag,
    parse_mesh_spec,
    resolve_mesh_shape,
)
from sharding.rules import (
    RULES,
    batch_sharding,
    cache_shardings,
    logical_to_spec,
    partition_specs,
    state_shardings,
    variable_axes,
)

P = PartitionSpec


def abstract(name: str) -> HybridLM:
    return nnx.eval_shape(lambda: HybridLM(load_config(name), rngs=nnx.Rngs(0), dtype=jnp.float32))


def specs_by_path(model, mesh) -> dict[str, PartitionSpec]:
    flat = nnx.to_flat_state(partition_specs(model, mesh))
    return {".".join(str(p) for p in path): var.get_value() for path, var in flat}


# --- mesh --------------------------------------------------------------------------------------------
def test_parse_mesh_spec():
    assert parse_mesh_spec("data=1,expert=4,tensor=2") == {"data": 1, "expert": 4, "tensor": 2}
    assert parse_mesh_spec("tensor=8") == {"data": 1, "expert": 1, "tensor": 8}
    assert parse_mesh_spec(" expert = 2 , tensor=*") == {"data": 1, "expert": 2, "tensor": -1}
    assert parse_mesh_spec({"expert": 8}) == {"data": 1, "expert": 8, "tensor": 1}
    assert parse_mesh_spec(None) == {"data": 1, "expert": 1, "tensor": 1}
    assert resolve_mesh_shape("expert=2,data=-1", 8) == {"data": 4, "expert": 2, "tensor": 1}


@pytest.mark.parametrize(
    "spec, match",
    [
        ("data=2,pipeline=4", "unknown axis 'pipeline'"),
        ("data=2,data=4", "given twice"),
        ("tensor=0", "positive integer"),
        ("tensor=two", "positive integer"),
        ("tensor=1.5", "positive integer"),
        ("tensor", "not AXIS=SIZE"),
        ("data=*,tensor=-1", "at most one axis"),
        ("data=2,tensor=2", "needs 4 devices but there are 8"),
        ("expert=3,tensor=*", "do not divide"),
    ],
)
def test_bad_mesh_specs(spec, match):
    with pytest.raises(MeshSpecError, match=match):
        make_mesh(spec)


def test_make_mesh_axes_and_types():
    mesh = make_mesh("data=2,expert=2,tensor=2")
    assert mesh.axis_names == ("data", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.reshape(-1)) == sorted(d.id for d in jax.devices())
    sub = make_mesh("tensor=4", devices=jax.devices()[:4])
    assert dict(sub.shape) == {"data": 1, "expert": 1, "tensor": 4}


# --- rules -------------------------------------------------------------------------------------------
def test_every_variable_has_logical_names():
    for name in ("tiny", "tiny-grouped", "tiny-k3"):
        state = nnx.state(abstract(name))
        for path, var in nnx.to_flat_state(state):
            axes = variable_axes(var)
            assert axes is not None, path
            assert len(axes) == len(var.get_value().shape), path
            assert all(a is None or a in RULES for a in axes), (path, axes)


def test_parameter_specs_tiny_on_2x2x2():
    mesh = make_mesh("data=2,expert=2,tensor=2")
    specs = specs_by_path(abstract("tiny"), mesh)
    assert specs["model.embed_tokens.weight"] == P("tensor")
    assert specs["lm_head.weight"] == P("tensor")
    assert specs["model.norm.weight"] == P()
    kda = "model.layers.0.self_attn"
    assert specs[f"{kda}.q_proj.weight"] == P("tensor")
    assert specs[f"{kda}.q_conv1d.weight"] == P("tensor")
    assert specs[f"{kda}.A_log"] == P(None, None, "tensor")
    assert specs[f"{kda}.b_proj.weight"] == P("tensor")
    assert specs[f"{kda}.o_proj.weight"] == P(None, "tensor")
    assert specs[f"{kda}.f_a_proj.weight"] == P()
    mla = "model.layers.3.self_attn"
    assert specs[f"{mla}.q_proj.weight"] == P("tensor")
    assert specs[f"{mla}.kv_b_proj.weight"] == P("tensor")
    assert specs[f"{mla}.kv_a_proj_with_mqa.weight"] == P()  # the latent is replicated
    assert specs[f"{mla}.o_proj.weight"] == P(None, "tensor")
    assert specs["model.layers.0.mlp.gate_proj.weight"] == P("tensor")
    assert specs["model.layers.0.mlp.down_proj.weight"] == P(None, "tensor")
    moe = "model.layers.1.block_sparse_moe"
    assert specs[f"{moe}.experts.w1"] == P("expert", "tensor")
    assert specs[f"{moe}.experts.w2"] == P("expert", None, "tensor")
    assert specs[f"{moe}.gate.weight"] == P()
    assert specs[f"{moe}.gate.e_score_correction_bias"] == P()
    assert specs[f"{moe}.shared_experts.up_proj.weight"] == P("tensor")


def test_parameter_specs_of_k3_tensors_on_2x2x2():
    mesh = make_mesh("data=2,expert=2,tensor=2")
    specs = specs_by_path(abstract("tiny-k3"), mesh)
    kda, mla, moe = "model.layers.0.self_attn", "model.layers.3.self_attn", "model.layers.1.block_sparse_moe"
    assert specs[f"{kda}.g_proj.weight"] == P("tensor")  # full-rank gate: head-major rows, like q_proj
    assert specs[f"{kda}.A_log"] == P()  # padded past the heads: replicated
    assert specs[f"{mla}.g_proj.weight"] == P("tensor")  # output gate: head-major rows
    assert specs[f"{moe}.routed_expert_down_proj.weight"] == P()  # the latent stays whole, like embed
    assert specs[f"{moe}.routed_expert_up_proj.weight"] == P()
    assert specs[f"{moe}.routed_expert_norm.weight"] == P()
    assert specs[f"{moe}.experts.w1"] == P("expert", "tensor")
    assert specs[f"{moe}.experts.w2"] == P("expert", None, "tensor")
    for name in ("self_attention_res", "mlp_res"):
        assert specs[f"model.layers.5.{name}_norm.weight"] == P()
        assert specs[f"model.layers.5.{name}_proj.weight"] == P()
    assert specs["model.output_attn_res_proj.weight"] == P()


def test_fallbacks_replicate_what_does_not_divide():
    # tiny has 2 heads: tensor=4 would split heads, so attention stays whole; widths still split.
    mesh = make_mesh("data=2,tensor=4")
    specs = specs_by_path(abstract("tiny"), mesh)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P()
    assert specs["model.layers.3.self_attn.kv_b_proj.weight"] == P()
    assert specs["model.embed_tokens.weight"] == P("tensor")
    assert specs["model.layers.1.block_sparse_moe.experts.w1"] == P(None, "tensor")
    # tiny-grouped: 3 heads on tensor=2 -> replicated; 16 experts on expert=8 -> split.
    mesh = make_mesh("expert=4,tensor=2")
    specs = specs_by_path(abstract("tiny-grouped"), mesh)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == P()
    assert specs["model.layers.1.block_sparse_moe.experts.w1"] == P("expert", "tensor")
    assert specs["model.embed_tokens.weight"] == P("tensor")  # vocab 300 splits 2 ways
    assert logical_to_spec(("vocab", "embed"), (300, 48), mesh) == P("tensor")
    assert logical_to_spec(("vocab", "embed"), (301, 48), mesh) == P()
    # tuple rules fall back to the longest dividing prefix; a mesh axis is used once per array
    mesh = make_mesh("data=2,expert=4")
    assert logical_to_spec(("batch", None), (8, 3), mesh) == P(("data", "expert"))
    assert logical_to_spec(("batch", None), (6, 3), mesh) == P("data")
    assert logical_to_spec(("batch", None), (3, 3), mesh) == P()
    assert logical_to_spec(("experts", "batch"), (8, 8), mesh) == P("expert", "data")
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("vocabulary",), (8,), mesh)


def test_state_shardings_structure_matches_state():
    mesh = make_mesh("expert=4,tensor=2")
    model = abstract("tiny")
    shardings = state_shardings(model, mesh)
    state = nnx.state(model)
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    for s in jax.tree.leaves(shardings):
        assert s.mesh == mesh


def test_cache_shardings():
    cfg = load_config("tiny")
    mesh = make_mesh("data=2,expert=2,tensor=2")
    per_layer = cache_shardings(cfg, mesh, slots=8, num_blocks=33, block_size=16)
    assert len(per_layer) == cfg.num_hidden_layers
    for kind, s in zip(cfg.layer_types, per_layer, strict=True):
        if kind == "kda":
            assert s["conv"].spec == P(("data", "expert"), "tensor")
            assert s["state"].spec == P(("data", "expert"), "tensor")
        else:
            assert s["pool"].spec == P()  # latent replicated, blocks global (see sharding.rules)
    # 6 slots do not split 4 ways: slots fall back to data only
    per_layer = cache_shardings(cfg, mesh, slots=6, num_blocks=33, block_size=16)
    assert per_layer[0]["state"].spec == P("data", "tensor")
    assert batch_sharding(mesh, (4, 7)).spec == P(("data", "expert"))


def test_mesh_flag():
    parser = argparse.ArgumentParser()
    add_mesh_argument(parser)
    args = parser.parse_args(["--mesh", "data=1,expert=4,tensor=2"])
    assert dict(mesh_from_flag(args.mesh).shape) == {"data": 1, "expert": 4, "tensor": 2}
    assert mesh_from_flag(parser.parse_args([]).mesh) is None

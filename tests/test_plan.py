"""`jaxhybrid plan`: its bytes per device against what 8 simulated devices really hold, hand-counted packed
experts, the refusal, --json, and (Hypothesis) that the recommended mesh fits and is the most that fits."""

import json
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.cache import SCRATCH_BLOCK
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.cli import main
from serve.engine.engine import Engine, EngineConfig
from serve.plan import Planner, PlanRequest
from sharding.mesh import make_mesh
from sharding.placement import shard_model
from sharding.plan import ModelShapes, abstract_mesh

CONTEXT, BLOCK, CHUNK = 64, 8, 32


@pytest.fixture(scope="module")
def planner():
    return Planner(load_config("tiny-k3"))


def per_device(arrays) -> Counter:
    """Bytes each device holds of `arrays` (every addressable shard)."""
    held = Counter()
    for x in jax.tree.leaves(arrays):
        for shard in x.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


def test_plan_bytes_are_what_each_device_holds(planner):
    """tiny-k3 on a replica of all 8 devices (expert=4 x tensor=2): after loading, each device holds the
    plan's expert and other-weight bytes; after the engine allocates its pools, its KV and state bytes; a
    checkpoint (`take`) holds the plan's bytes per checkpoint. Exact, no rounding."""
    req = PlanRequest(
        chips=8,
        hbm_bytes=3_500_000,
        context=CONTEXT,
        block_size=BLOCK,
        prefill_chunk=CHUNK,
        dtype="float32",
        checkpoint_interval=16,
        mesh={"expert": 4, "tensor": 2},
    )
    plan = planner.plan(req).chosen
    assert plan is not None and plan.data == 1 and plan.slots >= 4
    cfg = load_config("tiny-k3")
    mesh = make_mesh("data=1,expert=4,tensor=2")
    model = shard_model(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
    state = nnx.state(model)
    experts = [
        v for path, v in nnx.to_flat_state(state) if "experts" in path and "shared_experts" not in path
    ]
    assert set(per_device(experts).values()) == {plan.bytes.experts}
    assert set(per_device(state).values()) == {plan.bytes.experts + plan.bytes.other_weights}

    config = EngineConfig(
        max_slots=plan.slots, block_size=BLOCK, prefill_chunk=CHUNK, max_model_len=CONTEXT, prefix=None
    )
    engine = Engine(model, config, mesh=mesh)
    assert engine.shape.num_blocks == plan.num_blocks
    kinds = cfg.layer_types
    pools = engine.runner.pools
    kv = [p for k, p in zip(kinds, pools, strict=True) if k != "kda"]
    states = [p for k, p in zip(kinds, pools, strict=True) if k == "kda"]
    assert set(per_device(kv).values()) == {plan.bytes.kv_pool}
    assert set(per_device(states).values()) == {plan.bytes.live_states}
    assert plan.bytes.scanned_copy == 0  # attention residuals: the engine does not scan tiny-k3

    # CONTEXT // 16 interval checkpoints per sequence, each one slot's states as `take` leaves them
    assert plan.checkpoints_per_device == plan.slots * (CONTEXT // 16)
    taken, _ = engine.runner.copies.take(0, SCRATCH_BLOCK)
    one = plan.bytes.checkpoints // plan.checkpoints_per_device
    assert set(per_device(taken).values()) == {one}
    assert plan.device_cache_bytes == plan.checkpoints_per_device * engine.shape.state_bytes


def test_packed_experts_are_counted_per_shard_by_hand():
    """tiny-k3 with MXFP4 experts (13 MoE layers of E=8 experts, F=32, latent D=64): w1/w3 [E, F, D] pack to
    [E, F, 32] + scales [E, F, 2], w2 [E, D, F] to [E, D, 16] + [E, D, 1]. On expert=2 x tensor=2 the
    scales of w2 (one column) cannot split over tensor and stay whole on it."""
    cfg = load_config("tiny-k3").replace(expert_quant="mxfp4")
    one = abstract_mesh({})
    packed, dense = ModelShapes(cfg, jnp.float32, packed=True), ModelShapes(cfg, jnp.float32, packed=False)
    assert packed.weight_bytes(one).experts == 13 * 3 * (8 * 32 * 32 + 8 * 32 * 2)
    assert dense.weight_bytes(one).experts == 13 * 3 * 8 * 32 * 64 * 4
    assert packed.weight_bytes(one).other == dense.weight_bytes(one).other
    w1 = 4 * 16 * 32 + 4 * 16 * 2  # [E/2, F/2, D/2] + [E/2, F/2, D/32]
    w2 = 4 * 64 * 8 + 4 * 64 * 1  # [E/2, D, F/4] + [E/2, D, 1]
    assert packed.weight_bytes(abstract_mesh({"expert": 2, "tensor": 2})).experts == 13 * (2 * w1 + w2)


ARGS = ["plan", "--config", "tiny-k3", "--block-size", "8", "--prefill-chunk", "32", "--context", "64"]


def test_plan_refuses_when_nothing_fits(capsys):
    assert main([*ARGS, "--chips", "4", "--hbm", "0.001"]) == 1
    out = capsys.readouterr()
    assert "error: nothing fits tiny-k3" in out.err and "does not fit" in out.err
    assert "Traceback" not in out.err


def test_plan_json(capsys):
    assert main([*ARGS, "--chips", "4", "--hbm", "0.004", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["chosen"]
    kinds = {k: v for k, v in chosen["bytes"].items() if k != "total"}
    assert chosen["bytes"]["total"] == sum(kinds.values()) <= 4_000_000
    assert chosen["sequences_per_slice"] == chosen["slots"] * chosen["data"]
    assert chosen["sequences_per_slice"] == max(m["sequences_per_slice"] for m in out["fitting"])
    pairs = {(m["tensor"], m["expert"]) for m in out["fitting"] + out["rejected"]}
    assert pairs == {(t, e) for t in (1, 2, 4) for e in (1, 2, 4) if t * e <= 4 and 4 % (t * e) == 0}
    assert all(r["reason"] for r in out["rejected"])
    # tensor groups kept within a host of 2 chips
    assert main([*ARGS, "--chips", "4", "--hbm", "0.004", "--chips-per-host", "2", "--json"]) == 0
    hosts = json.loads(capsys.readouterr().out)
    assert all(m["tensor"] <= 2 for m in hosts["fitting"])
    assert any("spans more than one host" in r["reason"] for r in hosts["rejected"] if r["tensor"] == 4)
    # a sweep: one plan per combination
    assert main([*ARGS, "--chips", "2,4", "--hbm", "0.004", "--context", "32,64", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["plans"]) == 4


def test_plan_counts_at_the_models_own_context_unless_told(capsys):
    """Like `info`, plan counts a sequence at the model's own context (tiny-k3: 4,096 tokens, its
    max_position_embeddings) when no --context is given: 64 times the KV pool per sequence of 64 tokens."""
    bare = ["plan", "--config", "tiny-k3", "--block-size", "8", "--prefill-chunk", "32", "--chips", "1"]
    assert main([*bare, "--hbm", "1", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["request"]["context"] == load_config("tiny-k3").max_position_embeddings == 4096
    assert main([*bare, "--hbm", "1", "--context", "64", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["request"]["context"] == 64
    # the KV pool per sequence: context / block size blocks of block size latents (one scratch block aside)
    per_sequence = lambda plan: plan["chosen"]["bytes"]["kv_pool"] / plan["chosen"]["slots"]  # noqa: E731
    assert per_sequence(own) == pytest.approx(64 * per_sequence(short), rel=0.02)


@settings(max_examples=8, deadline=None)
@given(
    chips=st.sampled_from([1, 2, 3, 4, 6, 8]),
    hbm=st.integers(500_000, 20_000_000),
    context=st.sampled_from([16, 64, 200]),
    interval=st.sampled_from([0, 8, 32]),
)
def test_recommended_mesh_fits_and_is_the_most(planner, chips, hbm, context, interval):
    req = PlanRequest(
        chips, hbm, context, block_size=BLOCK, prefill_chunk=CHUNK, checkpoint_interval=interval
    )
    plan = planner.plan(req)
    assert all(r.reason for r in plan.rejected)
    assert len(plan.fitting) + len(plan.rejected) == sum(
        1
        for t in range(1, chips + 1)
        if chips % t == 0
        for e in range(1, chips // t + 1)
        if (chips // t) % e == 0
    )
    for m in plan.fitting:
        assert m.bytes.total <= hbm
        more = planner.mesh_plan(req, m.tensor, m.expert, m.slots + 1)
        assert more.bytes.total > hbm  # the slots are the most that fit
    if plan.chosen is not None:
        assert plan.chosen.sequences_per_slice == max(m.sequences_per_slice for m in plan.fitting)


def test_scanned_copy_is_what_the_engine_stacks():
    """A model whose engine scans its repeated layers (K K M twice after the dense layer, scan_layers "all")
    holds a stacked copy of them besides the model's own arrays: the plan's scanned_copy, per device."""
    cfg = load_config("tiny").replace(
        num_hidden_layers=7, kda_layers=(1, 2, 3, 5, 6), full_attn_layers=(4, 7)
    )
    req = PlanRequest(
        2, 10**8, CONTEXT, block_size=BLOCK, prefill_chunk=CHUNK, dtype="float32", scan_layers="all"
    )
    plan = Planner(cfg).mesh_plan(req, tensor=2, expert=1, slots=2)
    assert plan.bytes.scanned_copy > 0
    mesh = make_mesh("data=1,expert=1,tensor=2", jax.devices()[:2])
    model = shard_model(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
    config = EngineConfig(
        max_slots=2,
        block_size=BLOCK,
        prefill_chunk=CHUNK,
        max_model_len=CONTEXT,
        prefix=None,
        scan_layers="all",
    )
    engine = Engine(model, config, mesh=mesh)
    held = {id(x): x for x in jax.tree.leaves(nnx.state(model)) + jax.tree.leaves(engine.runner.scan_params)}
    weights = plan.bytes.experts + plan.bytes.other_weights
    assert set(per_device(list(held.values())).values()) == {weights + plan.bytes.scanned_copy}


def test_compile_without_a_topology_is_a_usage_error(capsys):
    assert main(["plan", "--config", "tiny", "--compile"]) == 2
    assert "--compile needs --topology" in capsys.readouterr().err


HLO = """
  %all-reduce.1 = f32[8,64]{1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %ag-start = (bf16[4,32]{1,0}, bf16[8,32]{1,0}) all-gather-start(%y), dimensions={0}
  %ag-done = bf16[8,32]{1,0} all-gather-done(%ag-start)
  ROOT %a2a = (bf16[2,16]{1,0}, bf16[2,16]{1,0}) all-to-all(%p, %q), dimensions={0}
  %add.3 = f32[8,64]{1,0} add(%all-reduce.1, %all-reduce.1)
"""


def test_collectives_are_counted_by_their_result_bytes():
    """A compiled module's collectives by kind: (count, bytes of the result on one device), an async pair
    once (its start's results), a tuple's parts summed; other ops are not collectives."""
    from serve.engine.topology import collectives

    assert collectives(HLO) == {
        "all-reduce": (1, 8 * 64 * 4),
        "all-gather": (1, 8 * 32 * 2),
        "all-to-all": (1, 2 * (2 * 16 * 2)),
    }


def test_the_roofline_is_the_slowest_of_flops_bytes_and_collectives():
    """One v5e device (197 TFLOP/s bf16, 819 GB/s, 400 GB/s ICI) and a TPU7x TensorCore (half a chip)."""
    from types import SimpleNamespace

    import numpy as np

    from serve.engine.topology import roofline_s

    def mesh(kind):
        return SimpleNamespace(devices=np.array([SimpleNamespace(device_kind=kind)]))

    assert roofline_s(mesh("TPU v5 lite"), 197e12, 819e6, 0) == pytest.approx(1.0)  # flops: 1 s
    assert roofline_s(mesh("TPU v5 lite"), 0, 819e9, 0) == pytest.approx(1.0)  # HBM: 1 s
    assert roofline_s(mesh("TPU v5 lite"), 0, 0, 800e9) == pytest.approx(2.0)  # ICI: 2 s
    assert roofline_s(mesh("TPU7x"), 2307e12 / 2, 0, 0) == pytest.approx(1.0)
    assert roofline_s(mesh("a CPU"), 1e9, 1e9, 0) is None

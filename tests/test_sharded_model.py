"""sharding.placement: parameters created in their shardings; sharded forward (TP/EP/DP) equals the unsharded
one; the cached forward on sharded engine pools; Orbax save on one mesh, restore onto another."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_network_bound, float32_sums_bound
from conftest import rel_err, subprocess_xla_flags
from flax import nnx
from jax.sharding import PartitionSpec

from jaxhybrid.cache import KDACache, PagedMLACache
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from sharding.checkpoint import save_state
from sharding.mesh import make_mesh
from sharding.placement import (
    abstract_model,
    create_sharded_model,
    load_sharded_model,
    pool_shardings,
    shard_model,
)
from sharding.rules import batch_sharding, state_shardings

# The tiny model cut to two layers (KDA + dense MLP, then MLA + MoE) so that each mesh compiles fast;
# the full 4-layer tiny model is checked on the four reference meshes by
# `test_full_tiny_logits_on_the_four_meshes` (see the error analysis there). A wrong placement is O(1).
CFG = load_config("tiny").replace(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,))
TOKENS = np.random.default_rng(1).integers(0, CFG.vocab_size, (4, 16), dtype=np.int32)  # as multihost_worker
# fp32 relative error max|a-b| / max|b|: a sharded program sums the same terms in other orders (per-device
# blocks, psums, the expert exchange): two float32 evaluations of the model (`bounds.float32_network_bound`)
TOL = float32_network_bound(CFG, TOKENS.shape[1])


def forward(model: HybridLM, tokens, mesh=None) -> np.ndarray:
    graphdef, state = nnx.split(model)
    if mesh is not None:
        tokens = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


@pytest.fixture(scope="module")
def sharded():
    """(model created on data=2,expert=2,tensor=2, its parameters on the host). The jitted init is the
    slow compile (~10 s on 2 cores), so other meshes get the same parameters through `shard_model`."""
    model = create_sharded_model(CFG, make_mesh("data=2,expert=2,tensor=2"), seed=0)
    return model, jax.tree.map(np.asarray, nnx.state(model))


def on_mesh(host_state, mesh) -> HybridLM:
    return shard_model(nnx.merge(nnx.graphdef(abstract_model(CFG)), host_state), mesh)


@pytest.fixture(scope="module")
def unsharded():
    """(jitted forward of host-resident state, graphdef): one compiled unsharded program for all meshes."""
    graphdef = nnx.graphdef(abstract_model(CFG))
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    return lambda model: np.asarray(fwd(jax.tree.map(np.asarray, nnx.state(model)), TOKENS))


def assert_placed(model: HybridLM, mesh) -> None:
    """Every parameter lives on `mesh` in exactly the sharding the rules give it."""
    want = jax.tree.leaves(state_shardings(model, mesh))
    got = jax.tree.leaves(nnx.state(model))
    assert len(want) == len(got)
    for w, a in zip(want, got, strict=True):
        assert a.sharding.is_equivalent_to(w, a.ndim), (a.sharding, w)


def test_create_sharded_model_equals_eager_init(sharded):
    model, host_state = sharded
    mesh = make_mesh("data=2,expert=2,tensor=2")
    assert_placed(model, mesh)
    moe = model.model.layers[1].block_sparse_moe
    assert moe.experts.w1[...].sharding.spec == PartitionSpec("expert", "tensor")
    assert moe.experts_fn is not None  # expert axis 2 divides 8 experts: EP installed
    shard = moe.experts.w1[...].addressable_shards[0].data
    assert shard.shape == (CFG.num_experts // 2, CFG.moe_intermediate_size // 2, CFG.hidden_size)
    eager = HybridLM(CFG, rngs=nnx.Rngs(0))
    # jit vs op-by-op init: same random bits, an initializer's few elementwise roundings fused or not
    pairs = zip(jax.tree.leaves(host_state), jax.tree.leaves(nnx.state(eager)), strict=True)
    assert max(rel_err(a, b) for a, b in pairs) < float32_sums_bound(ACTIVATION_ROUNDINGS, sides=2)


@pytest.mark.parametrize(
    "spec, devices, expert_parallel",
    [("data=2,expert=2,tensor=2", 8, True), ("expert=8", 8, True), ("tensor=4", 4, False)],
)
def test_sharded_logits_equal_unsharded(sharded, unsharded, spec, devices, expert_parallel):
    mesh = make_mesh(spec, devices=jax.devices()[:devices])
    model = sharded[0] if spec == "data=2,expert=2,tensor=2" else on_mesh(sharded[1], mesh)
    assert_placed(model, mesh)
    installed = model.model.layers[1].block_sparse_moe.experts_fn is not None
    assert installed == expert_parallel
    got = forward(model, TOKENS, mesh)
    want = unsharded(model)  # the same parameters on one device
    assert got.shape == (*TOKENS.shape, CFG.vocab_size)
    assert rel_err(got, want) < TOL


FULL = load_config("tiny")


@pytest.fixture(scope="module")
def full_tiny():
    """(host parameters of the 4-layer tiny model, seed 0; their single-device logits on TOKENS)."""
    host = jax.tree.map(np.asarray, nnx.state(HybridLM(FULL, rngs=nnx.Rngs(0))))
    graphdef = nnx.graphdef(abstract_model(FULL))
    return host, np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(host, TOKENS))


@pytest.mark.parametrize(
    "spec", ["data=1,expert=1,tensor=8", "data=1,expert=8,tensor=1", "data=2,expert=2,tensor=2", "data=8"]
)
def test_full_tiny_logits_on_the_four_meshes(full_tiny, spec):
    """The full tiny model (3 KDA + 1 MLA layers, 3 MoE layers) on each reference mesh equals one device.

    Error analysis (fp32, 4 x 16 tokens, 8 token seeds, per-layer traces): data=8 and tensor=8 give
    exactly 0 (data=8: 4 rows do not divide 8, activations stay whole and the program has no collective;
    tensor=8: its 20 all-reduces of split MLP/vocab products reproduce the single-device sums bit for bit
    on XLA:CPU for these shapes, which nothing guarantees elsewhere). The expert-parallel meshes differ by
    fp32 re-association (different per-device matmul shapes, the all_to_all dispatch, the weighted
    combine): ~2e-7 relative at the first KDA output. The KDA gated `o_norm` then rescales each (token,
    head) to unit RMS, with a gain up to 1/sqrt(eps) for heads whose output is tiny: the largest o_norm
    errors sit at heads whose
    rms(o) is 10x below the median and ~500x below max|o|, where the head's own relative error is
    1e-5..2e-4, so the max-norm error grows ~10x at every KDA layer (e.g. layer 3: o 1.9e-6 -> o_norm
    2.5e-5). That is the conditioning of the model at those points, not an accumulation bug: no ordering
    of fp32 sums removes it. The max-norm metric reports the worst such element relative to the largest
    logit; the Frobenius metric weighs it by its energy. Measured at the logits (max-norm / Frobenius),
    worst over 8 token seeds: expert=8 2.3e-5 / 5.7e-6; data=2,expert=2,tensor=2 3.2e-5 / 8.1e-6; on
    TOKENS (seed 1): 4.3e-6 / 1.4e-6 and 3.2e-6 / 1.2e-6. The bound is not those figures but two float32
    evaluations' (`bounds.float32_network_bound`: 6.1e-4 for tiny, 4 layers of ten sums of 128 terms),
    in the max norm; a wrong placement is O(1)."""
    host, want = full_tiny
    mesh = make_mesh(spec)
    model = shard_model(nnx.merge(nnx.graphdef(abstract_model(FULL)), host), mesh)
    assert_placed(model, mesh)
    assert (model.model.layers[1].block_sparse_moe.experts_fn is not None) == (mesh.shape["expert"] > 1)
    got = forward(model, TOKENS, mesh)
    assert rel_err(got, want) < float32_network_bound(FULL, TOKENS.shape[1])


def test_cached_forward_on_sharded_pools(sharded):
    """forward_cached over paged MLA pools and slot-indexed KDA pools placed by `pool_shardings`, run with
    pools as jit in/out shardings (the engine's layout), equals the unsharded run."""
    mesh = make_mesh("data=2,expert=2,tensor=2")
    model = sharded[0]
    slots, block_size, num_blocks, T = 4, 8, 9, 12
    shardings = pool_shardings(CFG, mesh, slots=slots, num_blocks=num_blocks, block_size=block_size)
    rng = np.random.default_rng(0)
    pools = tuple(
        KDACache(
            conv=rng.standard_normal(
                (slots, 3 * CFG.kda_proj_dim, CFG.short_conv_kernel_size - 1), np.float32
            ),
            state=rng.standard_normal(
                (slots, CFG.kda_num_heads, CFG.kda_head_dim, CFG.kda_head_dim), np.float32
            )
            * 0.1,
        )
        if kind == "kda"
        else np.zeros((num_blocks, block_size, CFG.latent_dim), np.float32)
        for kind in CFG.layer_types
    )
    block_table = np.arange(1, 9, dtype=np.int32).reshape(slots, 2)
    lengths = np.array([12, 10, 7, 12], np.int32)
    tokens = TOKENS[:, :T]

    def run(state, pools, tokens, lengths, graphdef):
        cache = tuple(
            p if isinstance(p, KDACache) else PagedMLACache(p, block_table, jnp.zeros((slots,), jnp.int32))
            for p in pools
        )
        logits, new = nnx.merge(graphdef, state).forward_cached(tokens, cache, lengths)
        return logits, tuple(c if isinstance(c, KDACache) else c.pool for c in new)

    graphdef, state = nnx.split(model)
    batch = batch_sharding(mesh, tokens.shape)
    sharded = jax.jit(
        lambda s, p, t, n: run(s, p, t, n, graphdef),
        in_shardings=(state_shardings(model, mesh), shardings, batch, batch_sharding(mesh, lengths.shape)),
        out_shardings=(batch_sharding(mesh, (slots, T, CFG.vocab_size)), shardings),
    )
    logits, new_pools = sharded(state, jax.device_put(pools, shardings), tokens, lengths)
    assert new_pools[0].state.sharding.spec == PartitionSpec(("data", "expert"), "tensor")

    host_state = jax.tree.map(np.asarray, state)
    ref_graphdef = nnx.graphdef(abstract_model(CFG))
    ref_logits, ref_pools = jax.jit(lambda s, p, t, n: run(s, p, t, n, ref_graphdef))(
        host_state, pools, tokens, lengths
    )
    valid = np.arange(T)[None, :] < lengths[:, None]
    assert rel_err(np.asarray(logits)[valid], np.asarray(ref_logits)[valid]) < TOL
    for a, b in zip(jax.tree.leaves(new_pools), jax.tree.leaves(ref_pools), strict=True):
        assert rel_err(a, b) < TOL


def test_checkpoint_restores_onto_a_different_mesh(tmp_path, sharded, unsharded):
    mesh_a = make_mesh("expert=4,tensor=2")
    model_a = on_mesh(sharded[1], mesh_a)
    save_state(tmp_path / "ckpt", model_a)
    saved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model_a))]
    want = unsharded(model_a)

    for spec in ("data=2,tensor=4", "expert=8"):
        mesh_b = make_mesh(spec)
        model_b = load_sharded_model(tmp_path / "ckpt", CFG, mesh_b)
        assert_placed(model_b, mesh_b)  # restored straight into the target shardings
        for a, b in zip(saved, jax.tree.leaves(nnx.state(model_b)), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
        if spec == "data=2,tensor=4":
            assert model_b.model.embed_tokens.weight[...].sharding.spec == PartitionSpec("tensor")
            assert rel_err(forward(model_b, TOKENS, mesh_b), want) < TOL
        else:
            w1 = model_b.model.layers[1].block_sparse_moe.experts.w1[...]
            assert w1.sharding.spec == PartitionSpec("expert")
            assert w1.addressable_shards[0].data.shape[0] == 1


def test_two_processes_on_localhost_match_single_process(tmp_path, sharded, unsharded):
    """Two processes x 4 CPU devices (gloo collectives) form one 8-device mesh expert=4,tensor=2: the
    expert all_to_all and the batch split cross the process boundary. Each process restores the
    parameters (saved here from data=2,expert=2,tensor=2) straight into its own shards with Orbax, runs
    the forward pass, and both get the single-process logits. (`multihost_worker.py` without
    --checkpoint creates the parameters with `create_sharded_model` instead; same result, but the jitted
    init compile makes that run ~35 s on 2 cores.)"""
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(CFG.to_hf_dict()))
    save_state(tmp_path / "ckpt", sharded[0])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = Path(__file__).with_name("multihost_worker.py")
    env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags()}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                f"--coordinator=127.0.0.1:{port}",
                "--num-processes=2",
                f"--process-id={i}",
                "--local-devices=4",
                "--mesh=expert=4,tensor=2",
                f"--config={config_path}",
                f"--batch={TOKENS.shape[0]}",
                f"--length={TOKENS.shape[1]}",
                f"--out={tmp_path / f'logits{i}.npy'}",
                f"--checkpoint={tmp_path / 'ckpt'}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    got = [np.load(tmp_path / f"logits{i}.npy") for i in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    assert rel_err(got[0], unsharded(sharded[0])) < TOL

"""sharding.expert_parallel: the dispatched MoE equals the unsharded dense/dropless experts on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from jax.sharding import PartitionSpec

from jaxhybrid.ops.moe import moe_experts_dense, moe_experts_dropless
from sharding.expert_parallel import make_expert_parallel_fn, ragged_all_to_all_emulated
from sharding.mesh import make_mesh

TOL = 1e-5


def problem(num_tokens: int, num_experts: int, k: int, skew: bool = False, dim: int = 16, ffn: int = 32):
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (num_tokens, dim), jnp.float32)
    w1 = jax.random.normal(ks[1], (num_experts, ffn, dim), jnp.float32) * 0.3
    w2 = jax.random.normal(ks[2], (num_experts, dim, ffn), jnp.float32) * 0.3
    w3 = jax.random.normal(ks[3], (num_experts, ffn, dim), jnp.float32) * 0.3
    if skew:  # every token's first choice is the same expert: one device gets all first choices
        n, j = jnp.arange(num_tokens)[:, None], jnp.arange(k)[None, :]
        ids = jnp.where(j == 0, 5, (6 + (n + j - 1) % (num_experts - 1)) % num_experts)
    else:  # distinct experts per token, like the router
        ids = jax.vmap(lambda key: jax.random.permutation(key, num_experts)[:k])(
            jax.random.split(ks[4], num_tokens)
        )
    weights = jax.random.uniform(ks[5], (num_tokens, k), jnp.float32)
    return x, w1, w2, w3, weights, ids.astype(jnp.int32)


@pytest.mark.parametrize(
    "spec, exchange, num_tokens, num_experts, k, skew",
    [
        ("expert=8", "padded", 13, 8, 2, False),
        ("expert=8", "ragged_emulated", 13, 8, 2, True),
        ("expert=4,tensor=2", "padded", 24, 16, 3, True),
        ("expert=4,tensor=2", "ragged_emulated", 24, 16, 3, False),
        ("data=2,expert=2,tensor=2", "padded", 7, 8, 2, False),
        ("data=2,expert=2,tensor=2", "ragged_emulated", 7, 8, 2, True),
    ],
)
def test_expert_parallel_equals_unsharded(spec, exchange, num_tokens, num_experts, k, skew):
    args = problem(num_tokens, num_experts, k, skew)
    mesh = make_mesh(spec)
    dense = jax.jit(moe_experts_dense)(*args)
    dropless = jax.jit(moe_experts_dropless)(*args)
    ep = jax.jit(make_expert_parallel_fn(mesh, exchange=exchange))(*args)
    assert ep.shape == dense.shape and ep.dtype == dense.dtype
    assert rel_err(ep, dense) < TOL
    assert rel_err(ep, dropless) < TOL


def test_auto_exchange_is_padded_on_cpu_and_sizes_are_checked():
    mesh = make_mesh("expert=8")
    fn = make_expert_parallel_fn(mesh)
    assert fn.exchange == ("padded" if jax.default_backend() == "cpu" else "ragged")
    f32, i32 = jnp.float32, jnp.int32
    shapes = [(8, 16, f32), (12, 32, 16, f32), (12, 16, 32, f32), (12, 32, 16, f32), (8, 2, f32), (8, 2, i32)]
    with pytest.raises(ValueError, match="divisible by 8"):  # 12 experts on 8 devices
        jax.eval_shape(fn, *(jax.ShapeDtypeStruct(s[:-1], s[-1]) for s in shapes))
    with pytest.raises(ValueError, match="exchange must be"):
        make_expert_parallel_fn(mesh, exchange="ragged-ish")


def test_ragged_exchange_lowers():
    """The real ragged path type-checks and lowers everywhere (rows, expert ids, results: three
    ragged_all_to_all); XLA:CPU then refuses to compile it, hence "padded" on CPU."""
    mesh = make_mesh("expert=4,tensor=2")
    shapes = [(13, 16), (8, 32, 16), (8, 16, 32), (8, 32, 16), (13, 2)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] + [jax.ShapeDtypeStruct((13, 2), jnp.int32)]
    lowered = jax.jit(make_expert_parallel_fn(mesh, exchange="ragged")).lower(*args)
    assert lowered.as_text().count("ragged_all_to_all") == 3


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="XLA:CPU does not implement ragged_all_to_all")
def test_ragged_exchange_on_accelerator():
    args = problem(16, 8, 2)
    mesh = make_mesh({"expert": jax.device_count()})
    ep = jax.jit(make_expert_parallel_fn(mesh, exchange="ragged"))(*args)
    assert rel_err(ep, jax.jit(moe_experts_dense)(*args)) < TOL


def test_emulated_ragged_all_to_all_matches_documented_example():
    """The example of the `jax.lax.ragged_all_to_all` docstring, on a 2-device axis."""
    mesh = make_mesh("expert=2,tensor=4")
    per_device = {
        "operand": [[1, 2, 2], [3, 4, 0]],
        "input_offsets": [[0, 1], [0, 1]],
        "send_sizes": [[1, 2], [1, 1]],
        "output_offsets": [[0, 0], [1, 2]],
        "recv_sizes": [[1, 1], [2, 1]],
    }
    arrays = {k: jnp.asarray(v, jnp.int32).reshape(-1) for k, v in per_device.items()}
    spec = PartitionSpec("expert")

    def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        out = jnp.zeros((4,), jnp.int32)
        return ragged_all_to_all_emulated(
            operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="expert"
        )

    result = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))(
        *(arrays[k] for k in per_device)
    )
    np.testing.assert_array_equal(np.asarray(result).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]])

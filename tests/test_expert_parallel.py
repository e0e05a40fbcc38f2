"""sharding.expert_parallel: the dispatched MoE equals the unsharded dense/dropless experts on 8 devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_sums_bound
from conftest import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec
from test_ops_moe import float64_experts

from jaxhybrid.ops.moe import moe_experts_dense, moe_experts_dropless
from sharding.expert_parallel import make_expert_parallel_fn, ragged_all_to_all_emulated
from sharding.mesh import make_mesh


def experts_tol(dim: int = 16, ffn: int = 32, k: int = 3, sides: int = 1) -> float:
    """The experts' chain of float32 sums (gate and up over dim, the activation, down over ffn, the weighted
    sum over k picks), against the float64 loop (sides 1) or another float32 form (2). A sum split over the
    devices and combined by a psum is one more order of the same K terms: gamma(K) covers any order."""
    return float32_sums_bound(dim, ACTIVATION_ROUNDINGS, ffn, k, sides=sides)


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
    assert rel_err(ep, dense) < experts_tol(k=k, sides=2)
    assert rel_err(ep, dropless) < experts_tol(k=k, sides=2)


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
    assert rel_err(ep, jax.jit(moe_experts_dense)(*args)) < experts_tol(k=2, sides=2)


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


# --- the ragged path's bookkeeping, against oracles ------------------------------------------------------

EP = 8  # devices on the expert axis of "expert=8"
ROWS = 20  # operand and output rows per device in the emulation tests


def ragged_problem(seed: int, max_size: int) -> dict[str, np.ndarray]:
    """Per device (leading axis): an operand, a prefilled output, and a valid ragged_all_to_all layout:
    every (source, destination) chunk of up to `max_size` rows at a random place in the source's operand
    and in the destination's output, chunks never overlapping, gaps and orders random."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_size + 1, (EP, EP))  # [src, dst]

    def place(lengths: np.ndarray) -> np.ndarray:
        offsets, cursor = np.zeros(len(lengths), np.int64), 0
        slack = ROWS - lengths.sum()
        for i in rng.permutation(len(lengths)):
            gap = rng.integers(0, slack + 1)
            slack -= gap
            offsets[i], cursor = cursor + gap, cursor + gap + lengths[i]
        return offsets

    input_offsets = np.stack([place(sizes[s]) for s in range(EP)])  # [src, dst]
    output_offsets = np.stack([place(sizes[:, d]) for d in range(EP)]).T  # [src, dst]: where it lands at dst
    return {
        "operand": rng.standard_normal((EP, ROWS, 2)).astype(np.float32),
        "output": rng.standard_normal((EP, ROWS, 2)).astype(np.float32),
        "input_offsets": input_offsets.astype(np.int32),
        "send_sizes": sizes.astype(np.int32),
        "output_offsets": output_offsets.astype(np.int32),
        "recv_sizes": sizes.T.astype(np.int32),  # [dst, src]
    }


def numpy_ragged_all_to_all(p: dict[str, np.ndarray]) -> np.ndarray:
    """The docstring of `jax.lax.ragged_all_to_all`, one device at a time: receiver d's result is its output
    with source s's rows operand_s[input_offsets_s[d] : + send_sizes_s[d]] at output_offsets_s[d]."""
    result = p["output"].copy()
    for s in range(EP):
        for d in range(EP):
            n, a, b = p["send_sizes"][s, d], p["input_offsets"][s, d], p["output_offsets"][s, d]
            result[d, b : b + n] = p["operand"][s, a : a + n]
    return result


@functools.cache
def emulated_on_mesh():
    spec = PartitionSpec("expert")

    def body(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return ragged_all_to_all_emulated(
            operand[0],
            output[0],
            input_offsets[0],
            send_sizes[0],
            output_offsets[0],
            recv_sizes[0],
            axis_name="expert",
        )[None]

    return jax.jit(jax.shard_map(body, mesh=make_mesh("expert=8"), in_specs=(spec,) * 6, out_specs=spec))


def run_emulated(p: dict[str, np.ndarray]) -> np.ndarray:
    keys = ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    return np.asarray(emulated_on_mesh()(*(jnp.asarray(p[k]) for k in keys)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_size=st.integers(0, 2))
def test_emulated_ragged_all_to_all_follows_the_documented_semantics(seed, max_size):
    p = ragged_problem(seed, max_size)
    np.testing.assert_array_equal(run_emulated(p), numpy_ragged_all_to_all(p))


def test_emulated_ragged_all_to_all_poisons_sizes_that_disagree():
    """recv_sizes must be what the senders send (`send_sizes == all_to_all(recv_sizes)`): a receiver whose
    recv_sizes disagree gets NaN, the others their rows."""
    p = ragged_problem(3, 2)
    p["recv_sizes"][5, 2] += 1  # device 5 expects one row more from device 2 than device 2 sends
    got, want = run_emulated(p), numpy_ragged_all_to_all(p)
    assert np.isnan(got[5]).all()
    np.testing.assert_array_equal(np.delete(got, 5, axis=0), np.delete(want, 5, axis=0))


ROUTINGS = ("any", "one-device", "one-expert", "distinct")


def routing(rng: np.random.Generator, kind: str, n: int, e: int, k: int) -> np.ndarray:
    """Expert ids [n, k]: any (repeats within a token, experts unused), every pair on the experts of one
    device (its receive buffer full, the others receive nothing), one expert for all, or distinct ones."""
    if kind == "any":
        return rng.integers(0, e, (n, k))
    if kind == "one-device":
        per = e // EP if e >= EP else 1
        first = rng.integers(0, e // per) * per
        return first + rng.integers(0, per, (n, k))
    if kind == "one-expert":
        return np.full((n, k), rng.integers(0, e))
    return np.stack([rng.permutation(e)[:k] for _ in range(n)])


@functools.cache
def ep_fn(spec: str, exchange: str):
    return jax.jit(make_expert_parallel_fn(make_mesh(spec), exchange=exchange))


@pytest.mark.parametrize("spec", ["expert=8", "expert=4,tensor=2"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(ROUTINGS), all_valid=st.booleans())
def test_ragged_dispatch_equals_the_float64_experts(spec, seed, kind, all_valid):
    """The ragged exchange (the emulated collective, so every other line of it runs) over routings that
    stress its offsets: repeated ids, unused experts, everything to one device; rows not valid add nothing."""
    n, e, k = 13, 16, 3
    x, w1, w2, w3, _, _ = problem(n, e, k)
    rng = np.random.default_rng(seed)
    ids = routing(rng, kind, n, e, k).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    valid = np.ones(n, bool) if all_valid else rng.uniform(size=n) < 0.6
    got = ep_fn(spec, "ragged_emulated")(x, w1, w2, w3, jnp.asarray(weights), jnp.asarray(ids), valid=valid)
    want = float64_experts(x, w1, w2, w3, weights, ids, valid)
    assert np.all(np.asarray(got)[~valid] == 0.0)
    assert rel_err(got, want) < experts_tol(k=k)

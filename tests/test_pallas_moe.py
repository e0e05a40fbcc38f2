"""The Pallas grouped expert matmul (`jaxhybrid.ops.pallas.moe`): in Pallas's interpreter on the CPU it equals
a per-expert float64 product with the weights dequantized by the NumPy reference (`weights.mxfp4`), for
ragged group sizes with empty groups and rows past the groups; its cost estimate bounds the bytes its blocks
move, counted from its grid; and compiled for a TPU (v5e:2x2, through Mosaic, inside the expert-parallel
shard_map) the engine's expert layer runs it on the packed codes, with no dequantized expert in the module."""

from __future__ import annotations

import functools
import importlib.util
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.ops import moe
from jaxhybrid.ops.mxfp4 import MXFP4
from jaxhybrid.ops.pallas import moe as pallas_moe
from jaxhybrid.weights.mxfp4 import dequantize_mxfp4

_HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
# Tiles small enough that tiny shapes have several row tiles (16 rows) and output column tiles (128 columns
# of 32 code bytes each), so groups start and end inside tiles and tiles are revisited.
TILES = {
    "default": {
        "MAX_TILE_ROWS": pallas_moe.MAX_TILE_ROWS,
        "MAX_TILE_WEIGHT_BYTES": pallas_moe.MAX_TILE_WEIGHT_BYTES,
    },
    "small": {"MAX_TILE_ROWS": 16, "MAX_TILE_WEIGHT_BYTES": 128 * 32},
}


@functools.cache
def _interpreted(tiles: str):
    """One jitted interpreter run per tile setting (Hypothesis's examples reuse its compile)."""
    return jax.jit(functools.partial(pallas_moe.grouped_matmul, interpret=True))


def run_kernel(x, w, sizes, tiles: str = "default"):
    with mock.patch.multiple(pallas_moe, **TILES[tiles]):
        return np.asarray(_interpreted(tiles)(x, w, jnp.asarray(sizes, jnp.int32)))


def packed(rng: np.random.Generator, groups: int, n: int, k: int) -> MXFP4:
    """Random codes (every E2M1 value, both signs) and scales 2^-6 .. 2^1."""
    codes = rng.integers(0, 256, (groups, n, k // 2), dtype=np.uint8)
    scales = rng.integers(121, 129, (groups, n, k // 32), dtype=np.uint8)
    return MXFP4(jnp.asarray(codes), jnp.asarray(scales))


def oracle(x, w, sizes) -> np.ndarray:
    """Float64: each group's rows times its expert's weight, dequantized by NumPy; rows past the groups 0."""
    dense = w if not isinstance(w, MXFP4) else dequantize_mxfp4(np.asarray(w.packed), np.asarray(w.scale))
    dense, x = np.asarray(dense, np.float64), np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], dense.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ dense[g].T
        start += size
    return out


def assert_close(got, want, x, w_abs_max, k):
    """fp32 against float64: the kernel sums the even and the odd columns apart, then adds the two (XLA sums
    in another order), so each output may be off by about k float32 roundings of the magnitude of its
    terms, |x| |w| k; 1e-5 of that bound is ~100 ulps at k = 64, far below a wrong row or scale (>= 1/8)."""
    bound = np.max(np.abs(np.asarray(x, np.float64))) * w_abs_max * k
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * bound)


def ragged_sizes(groups: int, rows: int):
    """Group sizes with empty groups and some rows past the groups (sum <= rows)."""
    return st.lists(st.integers(0, rows), min_size=groups, max_size=groups).map(
        lambda s: [int(v) for v in np.minimum(s, np.maximum(0, rows - np.cumsum([0, *s[:-1]])))]
    )


@settings(max_examples=12, deadline=None)
@given(
    sizes=ragged_sizes(6, 40),
    tiles=st.sampled_from(["default", "small"]),
    n=st.sampled_from([256, 200]),  # small tiles: 2 column tiles of 128, the last one partial for 200
    seed=st.integers(0, 2**16),
)
def test_packed_kernel_equals_the_dequantized_products(sizes, tiles, n, seed):
    rng = np.random.default_rng(seed)
    k = 64
    w = packed(rng, 6, n, k)
    x = jnp.asarray(rng.normal(size=(40, k)), jnp.float32)
    got = run_kernel(x, w, sizes, tiles)
    assert_close(got, oracle(x, w, sizes), x, 6.0 * 2.0, k)
    assert not np.any(got[sum(sizes) :])  # rows past the groups: exactly zero, as ragged_dot gives
    # ... and the reference it stands beside (XLA's ragged_dot over the used experts, dequantized) agrees
    assert_close(np.asarray(moe.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32))), got, x, 12.0, k)


@settings(max_examples=6, deadline=None)
@given(sizes=ragged_sizes(4, 24), seed=st.integers(0, 2**16))
def test_bfloat16_rows_multiply_the_exact_weights(sizes, seed):
    """bf16 rows: the dequantized tile is exact in bf16 (an E2M1 value times a power of two), the products
    are exact in f32; only the order of the f32 sums differs from the oracle's."""
    rng = np.random.default_rng(seed)
    w = packed(rng, 4, 32, 96)
    x = jnp.asarray(rng.normal(size=(24, 96)), jnp.bfloat16)
    assert_close(run_kernel(x, w, sizes), oracle(x, w, sizes), x, 12.0, 96)


@settings(max_examples=6, deadline=None)
@given(sizes=ragged_sizes(5, 40), tiles=st.sampled_from(["default", "small"]), seed=st.integers(0, 2**16))
def test_dense_experts_through_megablox_gmm(sizes, tiles, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(5, 256, 64)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(40, 64)), jnp.float32)
    got = run_kernel(x, w, sizes, tiles)
    assert_close(got, oracle(x, w, sizes), x, float(jnp.max(jnp.abs(w))), 64)
    assert not np.any(got[sum(sizes) :])


def grid_steps(m: int, k: int, n: int, sizes: list[int]) -> list[tuple[int, int]]:
    """The (expert, row tile) of each step of an output column tile, as the kernel is to run them: in expert
    order, one for every row tile an expert with rows touches (none for an expert without rows)."""
    tm, steps, start = pallas_moe.tiling(m, k, n, len(sizes), k // 2).tm, [], 0
    for g, size in enumerate(sizes):
        if size:
            steps += [(g, r) for r in range(start // tm, (start + size - 1) // tm + 1)]
        start += size
    return steps


def moved(m: int, k: int, n: int, sizes: list[int], itemsize: int) -> int:
    """The bytes the kernel's blocks move over its grid (`grid_steps` per output column tile), as the Pallas
    pipeline moves them: an input block is copied in when its index differs from the previous step's, an
    output block written back when its index changes and at the end; plus the scalar-prefetched metadata."""
    t = pallas_moe.tiling(m, k, n, len(sizes), k // 2)
    steps = grid_steps(m, k, n, sizes)
    total = 4 * (len(sizes) + 1 + 2 * (t.row_tiles + len(sizes) - 1))
    for _ in range(-(-n // t.tn)):
        last = (None, None)
        for g, r in steps:
            total += (g != last[0]) * t.tn * (k // 2 + k // 32)  # codes and scales of expert g
            total += (r != last[1]) * t.tm * k * itemsize  # the row tile (both halves of its columns)
            total += (r != last[1] and last[1] is not None) * t.tm * t.tn * 4  # the previous output tile
            last = (g, r)
        total += bool(steps) * t.tm * t.tn * 4
    return total


_metadata = jax.jit(pallas_moe.group_metadata, static_argnums=1)


@settings(max_examples=30, deadline=None)
@given(sizes=st.sampled_from([3, 12]).flatmap(lambda g: ragged_sizes(g, 300)), n=st.sampled_from([48, 1024]))
def test_the_grid_visits_only_experts_with_rows(sizes, n):
    """The kernel's group metadata (megablox's) gives exactly `grid_steps`: the weight BlockSpec indexes
    only experts with rows, each in one run of consecutive steps (its block is fetched once a column tile)."""
    m, k = 300, 64
    t = pallas_moe.tiling(m, k, n, len(sizes), k // 2)
    (_, group_ids, row_tiles), count = _metadata(jnp.asarray(sizes, jnp.int32), t)
    count = int(count)
    visited = list(
        zip(np.asarray(group_ids)[:count].tolist(), np.asarray(row_tiles)[:count].tolist(), strict=True)
    )
    assert visited == grid_steps(m, k, n, sizes)


def test_a_nan_expert_without_rows_leaves_no_trace():
    """E8M0 255 (NaN) scales in an expert with no rows, then in every expert with no row in any group: the
    result is finite (and zero where no row has a group)."""
    rng = np.random.default_rng(0)
    w = packed(rng, 4, 32, 64)
    w = MXFP4(w.packed, w.scale.at[1].set(255))
    x = jnp.asarray(rng.normal(size=(20, 64)), jnp.float32)
    got = run_kernel(x, w, [8, 0, 12, 0])
    assert np.all(np.isfinite(got))
    assert_close(got, oracle(x, w, [8, 0, 12, 0]), x, 12.0, 64)
    assert not np.any(run_kernel(x, MXFP4(w.packed, jnp.full_like(w.scale, 255)), [0, 0, 0, 0]))


def test_cost_estimate_counted_by_hand():
    """40 f32 rows of 64 columns over 5 packed experts [48, 64]: 8 rows an expert on average, so row tiles of
    16 (3 of them, 48 rows), and one column tile of 48; at most 5 experts read, 48 x (32 code bytes + 2
    scales) each; the row tiles, 48 x 64 x 4 bytes; the output tiles, 48 x 48 x 4; metadata, 6 offsets and
    2 x (3 + 5 - 1) step entries of 4 bytes. Steps: at most 3 + 5 - 1, each 2 x 16 x 48 x 64 flops."""
    cost = pallas_moe.cost_estimate(40, 64, 48, 5, jnp.float32)
    assert cost.bytes_accessed == 5 * 48 * 34 + 48 * 64 * 4 + 48 * 48 * 4 + 4 * (6 + 2 * 7)
    assert cost.flops == 7 * 2 * 16 * 48 * 64 and cost.transcendentals == 0
    assert moved(40, 64, 48, [8, 8, 8, 8, 8], 4) == cost.bytes_accessed  # every expert and row tile used


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.integers(1, 12).flatmap(lambda g: ragged_sizes(g, 300)),
    n=st.sampled_from([48, 256, 1024]),
    k=st.sampled_from([64, 512]),
)
def test_cost_estimate_bounds_the_blocks_moved(sizes, n, k):
    """The estimate (what XLA's cost analysis counts for the kernel in a program) is at least what the grid
    moves and multiplies for any group sizes, and exactly its bytes when every expert and row tile is used."""
    m = 300
    cost = pallas_moe.cost_estimate(m, k, n, len(sizes), jnp.bfloat16)
    t = pallas_moe.tiling(m, k, n, len(sizes), k // 2)
    assert moved(m, k, n, sizes, 2) <= cost.bytes_accessed
    assert -(-n // t.tn) * len(grid_steps(m, k, n, sizes)) * 2 * t.tm * t.tn * k <= cost.flops
    every = [max(1, v) for v in sizes]
    every[-1] += m - sum(every)
    if every[-1] > 0:
        assert moved(m, k, n, every, 2) == cost.bytes_accessed


def test_the_kernel_is_chosen_for_packed_experts_on_a_tpu_only():
    w = packed(np.random.default_rng(0), 2, 32, 64)
    assert moe.grouped_matmul_for(w, "tpu") is pallas_moe.grouped_matmul
    for platform in ("cpu", "gpu", None):  # the CPU's paths, and XLA's form where a kernel cannot run
        assert moe.grouped_matmul_for(w, platform) is moe.grouped_matmul
    assert moe.grouped_matmul_for(jnp.zeros((2, 32, 64)), "tpu") is moe.grouped_matmul


def kernel_calls(hlo_text: str) -> int:
    """The packed kernel's custom calls in a compiled module (XLA's own ragged_dot on a TPU is a Mosaic
    custom call too, named otherwise)."""
    return sum(
        1 for line in hlo_text.splitlines() if "custom-call(" in line and pallas_moe.KERNEL_NAME in line
    )


@pytest.fixture
def serving_precision():
    """The precision `serve` compiles at (the suite's HIGHEST asks Mosaic for bf16 products at HIGHEST)."""
    with jax.default_matmul_precision("default"):
        yield


@pytest.mark.skipif(not _HAS_LIBTPU, reason='libtpu is not installed (pip install -e ".[tpu]")')
@pytest.mark.parametrize("tensor", [1, 2])
def test_expert_parallel_layer_compiles_for_v5e_with_the_kernel_on_packed_codes(serving_precision, tensor):
    """The engine's expert layer (`make_expert_parallel_fn`, experts over 4 / tensor devices, F over tensor)
    compiled for v5e:2x2 from this host: three Mosaic kernels (gate, up, down) and no array of a whole expert
    dequantized (f32 or bf16 [.., F, D] or [.., D, F]) anywhere in the module."""
    from serve.engine.topology import topology_devices
    from sharding.expert_parallel import make_expert_parallel_fn
    from sharding.mesh import make_mesh

    mesh = make_mesh(
        {"data": 1, "expert": 4 // tensor, "tensor": tensor}, devices=topology_devices("v5e:2x2")
    )
    e, f, d, n, k = 8, 256, 512, 16, 2
    sharded = jax.sharding.NamedSharding

    def shape(dims, dtype, spec):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=sharded(mesh, jax.sharding.PartitionSpec(*spec)))

    t = "tensor" if tensor > 1 else None
    up = MXFP4(
        shape((e, f, d // 2), jnp.uint8, ("expert", t)), shape((e, f, d // 32), jnp.uint8, ("expert", t))
    )
    down = MXFP4(
        shape((e, d, f // 2), jnp.uint8, ("expert", None, t)),
        shape((e, d, f // 32), jnp.uint8, ("expert", None, t)),
    )
    x, weights, ids = (
        shape((n, d), jnp.bfloat16, ()),
        shape((n, k), jnp.float32, ()),
        shape((n, k), jnp.int32, ()),
    )
    compiled = jax.jit(make_expert_parallel_fn(mesh)).lower(x, up, down, up, weights, ids).compile()
    text = compiled.as_text()
    assert kernel_calls(text) == 3
    f_loc = f // tensor
    whole = rf"(f32|bf16)\[(\d+,)?({f_loc},{d}|{d},{f_loc})\]"
    assert re.search(whole, text) is None, re.search(whole, text)


@pytest.mark.skipif(not _HAS_LIBTPU, reason='libtpu is not installed (pip install -e ".[tpu]")')
def test_dropless_experts_take_the_kernel_inside_a_shard_map_only(serving_precision):
    """`moe_experts_dropless` with packed experts compiled for v5e:2x2: inside a shard_map over the whole mesh
    (each device's tokens, all experts) through the kernel; partitioned by XLA (no shard_map), where a
    Mosaic kernel cannot go, XLA's ragged_dot as before."""
    from serve.engine.topology import topology_devices

    mesh = jax.sharding.Mesh(np.array(topology_devices("v5e:2x2")), ("data",))
    e, f, d, n, k = 4, 128, 256, 32, 2
    spec = jax.sharding.PartitionSpec

    def shape(dims, dtype, rows=False):
        return jax.ShapeDtypeStruct(
            dims, dtype, sharding=jax.sharding.NamedSharding(mesh, spec("data" if rows else None))
        )

    up = MXFP4(shape((e, f, d // 2), jnp.uint8), shape((e, f, d // 32), jnp.uint8))
    down = MXFP4(shape((e, d, f // 2), jnp.uint8), shape((e, d, f // 32), jnp.uint8))
    args = (shape((n, d), jnp.bfloat16, True), up, down, up, shape((n, k), jnp.float32, True))
    args = (*args, shape((n, k), jnp.int32, True))
    local = jax.shard_map(
        moe.moe_experts_dropless,
        mesh=mesh,
        in_specs=(spec("data"), spec(), spec(), spec(), spec("data"), spec("data")),
        out_specs=spec("data"),
    )
    for fn, calls in [(local, 3), (moe.moe_experts_dropless, 0)]:
        assert kernel_calls(jax.jit(fn).lower(*args).compile().as_text()) == calls

"""The paged MLA decode kernel (`jaxhybrid.ops.pallas.mla`) against the gathered-view reference
(`jaxhybrid.ops.mla.mla_attention_paged_reference`), in Pallas's interpreter on the CPU, and compiled through
Mosaic for v5e, v6e and tpu7x topologies (deviceless, needs libtpu).

Tolerance, fp32: the kernel sums a row's softmax block by block (an online softmax: running max, rescaled
partial sums) where the reference sums all positions at once, so the two round differently; with scores and
latents of order 1 the outputs (order 1) agree to a few float32 ulps a term. 2e-5 absolute + relative is a
few hundred ulps of headroom and far below any indexing mistake (a wrong block, a position off by one
changes outputs by O(0.1)).
"""

from __future__ import annotations

import importlib.util
from unittest import mock

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxhybrid.ops import int8
from jaxhybrid.ops.mla import mla_attention_paged_reference
from jaxhybrid.ops.pallas import mla as pallas_mla
from jaxhybrid.ops.pallas.mla import (
    mla_paged_decode_blocks_read,
    mla_paged_decode_cost,
    mla_paged_decode_pallas,
)

TOL = 2e-5  # module docstring
NOPE, ROPE, RANK, V = 8, 4, 8, 4  # small head and latent widths: interpret mode's cost grows with them


def operands(rng, rows, tokens, heads, block_size, num_blocks, width=(NOPE, ROPE, RANK, V)):
    nope, rope, rank, v = width
    q = rng.normal(size=(rows, tokens, heads, nope + rope)).astype(np.float32)
    pool = rng.normal(size=(num_blocks, block_size, rank + rope)).astype(np.float32)
    weight = (rng.normal(size=(heads * (nope + v), rank)) * 0.3).astype(np.float32)
    return q, pool, weight


def both(q, pool, table, end, weight, *, clean_pool=None, nope=NOPE, v=V):
    """(kernel in interpret mode, reference); the reference reads `clean_pool` where given (the kernel's
    pool then has poison where no row may look)."""
    kw = dict(nope_dim=nope, v_dim=v, scale=(q.shape[-1]) ** -0.5)
    got = mla_paged_decode_pallas(q, pool, table, end, weight, interpret=True, **kw)
    ref_pool = pool if clean_pool is None else clean_pool
    want = mla_attention_paged_reference(q, ref_pool, table, end, weight, **kw)
    return np.asarray(got), np.asarray(want)


def poisoned(pool, table, end, block_size):
    """The pool with NaN at every position no token sees: past each row's last visible position (the rest of
    its last block, the blocks after it), and in blocks no row names. A kernel that used one (even times a
    zero weight) would give NaN."""
    out = np.full_like(pool, np.nan)
    end = np.asarray(end).reshape(table.shape[0], -1)
    for row, last in zip(table, end.max(axis=1), strict=True):
        for p in range(min(int(last), table.shape[1] * block_size)):
            out[row[p // block_size], p % block_size] = pool[row[p // block_size], p % block_size]
    return out


def test_matches_the_reference_on_fixed_rows():
    """Rows with nothing visible, one position, mid-block and full tables, an end past the table (it sees
    the table); two tokens with their own ends (a verify step); a block two rows share and one a row names
    twice."""
    rng = np.random.default_rng(0)
    q, pool, weight = operands(rng, rows=5, tokens=2, heads=3, block_size=4, num_blocks=7)
    table = np.array([[1, 2, 3], [3, 4, 0], [5, 5, 6], [2, 0, 0], [6, 1, 4]], np.int32)
    end = np.array([[0, 0], [1, 2], [6, 7], [12, 12], [11, 15]], np.int32)
    got, want = both(q, poisoned(pool, table, end, 4), table, end, weight, clean_pool=pool)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    assert np.all(got[0] == 0) and np.isfinite(got).all()


def test_per_row_ends_and_int8_weights():
    """`end` given per row ([B]: every token of the row sees the same positions) and kv_b as int8 codes
    (dequantized outside the kernel, as the reference does)."""
    rng = np.random.default_rng(1)
    q, pool, weight = operands(rng, rows=3, tokens=3, heads=2, block_size=8, num_blocks=5)
    table = np.array([[4, 1], [0, 2], [3, 3]], np.int32)
    end = np.array([16, 9, 3], np.int32)
    codes = int8.quantize(jnp.asarray(weight))
    got, want = both(q, pool, table, end, codes)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_bfloat16_as_the_engine_serves():
    """bfloat16 queries, pool and weight (the engine's serving dtype). Both forms round the probabilities to
    bfloat16 before the values' product, the kernel relative to a running max and the reference to the
    row's, and round the output to bfloat16: two bfloat16 ulps at 1 (2 * 2**-8; seen: 5e-4 on outputs up
    to 0.8)."""
    rng = np.random.default_rng(4)
    q, pool, weight = operands(rng, rows=3, tokens=2, heads=2, block_size=16, num_blocks=6)
    table = np.array([[1, 2, 3], [4, 5, 0], [2, 2, 2]], np.int32)
    end = np.array([[20, 21], [48, 48], [0, 7]], np.int32)
    q, pool, weight = (jnp.asarray(a, jnp.bfloat16) for a in (q, pool, weight))
    with mock.patch.object(pallas_mla, "POSITIONS_PER_STEP", 16):  # a block a step: the most rescaling
        got, want = both(q, pool, table, end, weight)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-7, atol=2**-7)


def test_rows_past_one_calls_prefetch_go_through_several_calls(monkeypatch):
    """More rows than one call's SMEM prefetch holds: the rows go in groups (a shorter last one) through calls
    over the same pool, and the result is the same."""
    rng = np.random.default_rng(2)
    q, pool, weight = operands(rng, rows=5, tokens=1, heads=2, block_size=4, num_blocks=6)
    table = rng.integers(0, 6, size=(5, 3)).astype(np.int32)
    end = np.array([[12], [0], [5], [8], [3]], np.int32)
    monkeypatch.setattr(pallas_mla, "SMEM_PREFETCH_BYTES", 2 * 4 * (3 + 1))  # two rows a call: 3 calls
    got, want = both(q, pool, table, end, weight)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@st.composite
def paged_cases(draw, max_rows=3, max_width=4):
    rows = draw(st.integers(1, max_rows))
    tokens = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([2, 4, 8]))
    width = draw(st.integers(1, max_width))
    num_blocks = draw(st.integers(1, rows * width + 1))  # few blocks: rows share some
    table = draw(
        st.lists(
            st.lists(st.integers(0, num_blocks - 1), min_size=width, max_size=width),
            min_size=rows,
            max_size=rows,
        )
    )
    full = width * block_size
    # each token's end: none visible, a block boundary, mid-block, or the whole table
    one_end = st.one_of(
        st.just(0),
        st.just(full),
        st.integers(0, width).map(lambda k: k * block_size),
        st.integers(0, full),
    )
    ends = draw(st.lists(st.lists(one_end, min_size=tokens, max_size=tokens), min_size=rows, max_size=rows))
    return rows, tokens, heads, block_size, num_blocks, np.array(table, np.int32), np.array(ends, np.int32)


def check_case(case, seed, per_step):
    """The kernel (reading `per_step` blocks a grid step) against the reference on a drawn case, with NaN
    wherever no token of a row looks."""
    rows, tokens, heads, block_size, num_blocks, table, end = case
    q, pool, weight = operands(np.random.default_rng(seed), rows, tokens, heads, block_size, num_blocks)
    with mock.patch.object(pallas_mla, "POSITIONS_PER_STEP", per_step * block_size):
        got, want = both(q, poisoned(pool, table, end, block_size), table, end, weight, clean_pool=pool)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_cases(), seed=st.integers(0, 2**31 - 1), per_step=st.sampled_from([1, 2, 64]))
def test_matches_the_reference_over_tables_and_ends(case, seed, per_step):
    check_case(case, seed, per_step)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_cases(max_rows=5, max_width=6), seed=st.integers(0, 2**31 - 1), per_step=st.integers(1, 4))
def test_matches_the_reference_over_more_tables_and_ends(case, seed, per_step):
    check_case(case, seed, per_step)


@pytest.mark.slow
def test_matches_the_reference_at_kimi_k3_widths():
    """K3's head widths (nope 128, rope 64, kv_lora_rank 512, v 128), a few heads and rows."""
    rng = np.random.default_rng(3)
    width = (128, 64, 512, 128)
    q, pool, weight = operands(rng, rows=2, tokens=2, heads=4, block_size=16, num_blocks=5, width=width)
    q, pool = q * 0.1, pool * 0.1  # scores of order 1 over 576 dims
    table = np.array([[1, 2, 3], [4, 0, 2]], np.int32)
    end = np.array([[40, 41], [17, 17]], np.int32)
    got, want = both(q, pool, table, end, weight, nope=128, v=128)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_the_cost_estimate_counts_every_table_block():
    """The static estimate against a count from the arrays the kernel touches: every row's whole table of pool
    blocks (as many bytes as the reference's gathered view), the queries in and the attention out at the
    latent's width, the table and the ends; the products and exponentials counted from the scores."""
    rows, tokens, heads, block_size, width, table_len = 5, 3, 4, 16, 40, 7
    view = np.zeros(
        (rows, table_len * block_size, width), jnp.bfloat16
    )  # pool[table], what the reference makes
    queries = np.zeros((rows, tokens * heads, width), jnp.bfloat16)
    table = np.zeros((rows, table_len), np.int32)
    ends = np.zeros((rows, tokens), np.int32)
    cost = mla_paged_decode_cost(
        (rows, tokens, heads, 24),
        (99, block_size, width),
        table.shape,
        q_dtype=jnp.bfloat16,
        pool_dtype=jnp.bfloat16,
    )
    assert cost.bytes_accessed == view.nbytes + 2 * queries.nbytes + table.nbytes + ends.nbytes
    scores = rows * tokens * heads * table_len * block_size
    assert cost.flops == scores * 2 * width * 2  # q.k and p.v, a multiply and an add each
    assert cost.transcendentals == scores + rows * table_len * tokens * heads


@settings(max_examples=50, deadline=None)
@given(case=paged_cases(max_rows=6, max_width=8), per_step=st.integers(1, 8))
def test_blocks_read_counts_the_blocks_below_each_rows_end(case, per_step):
    """Against a count by position: the table entries holding some position a token of the row sees, and
    at least one for each of the step's pool inputs (the first entry's block, for a row that sees nothing)."""
    rows, _, _, block_size, _, table, end = case
    inputs = min(per_step, table.shape[1])
    want = 0
    for r in range(rows):
        entries = {p // block_size for p in range(min(int(end[r].max()), table.shape[1] * block_size))}
        want += max(len(entries), inputs)
    with mock.patch.object(pallas_mla, "POSITIONS_PER_STEP", per_step * block_size):
        assert mla_paged_decode_blocks_read(table, end, block_size) == want


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='libtpu is not installed (pip install -e ".[tpu]")'
)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x4", "tpu7x:2x2x4"])
def test_compiles_through_mosaic_with_no_gathered_view(topology):
    """Inside `shard_map` over the topology's devices (rows split among them), the kernel compiles through
    Mosaic (a `tpu_custom_call`) and the program's temporaries stay far below one device's share of the
    gathered view the reference makes (``pool[block_table]``: every row's whole table of blocks; at these
    sizes XLA fuses the reference's gather into its products, at the engine's it does not: tiny-k3's 8,760
    rows make 12 GB of it) and far below a copy of the pool (what a pool in a layout other than Mosaic's
    row-major one would cost)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.array(devices), ("rows",))
    tokens, heads, block_size, table_len, num_blocks = 2, 4, 16, 64, 4096
    rows = 64 * len(devices)  # 64 a device
    nope, rope, rank, v = 32, 64, 64, 32  # a latent 128 wide: the pool's TPU layout is row-major, as Mosaic's
    kw = dict(nope_dim=nope, v_dim=v, scale=(nope + rope) ** -0.5)
    split, whole = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())
    args = (
        jax.ShapeDtypeStruct((rows, tokens, heads, nope + rope), jnp.bfloat16, sharding=split),
        jax.ShapeDtypeStruct((num_blocks, block_size, rank + rope), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((rows, table_len), jnp.int32, sharding=split),
        jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=split),
        jax.ShapeDtypeStruct((heads * (nope + v), rank), jnp.bfloat16, sharding=whole),
    )

    def kernel(*a):
        body = jax.shard_map(
            lambda *b: mla_paged_decode_pallas(*b, **kw),
            mesh=mesh,
            in_specs=(P("rows"), P(), P("rows"), P("rows"), P()),
            out_specs=P("rows"),
            check_vma=False,
        )
        return body(*a)

    view_bytes = rows // len(devices) * table_len * block_size * (rank + rope) * 2  # one device's rows, bf16
    with jax.default_matmul_precision("default"):
        compiled = jax.jit(kernel).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    pool_bytes = num_blocks * block_size * (rank + rope) * 2
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < min(view_bytes, pool_bytes) / 20, (temp, view_bytes, pool_bytes)
    cost = mla_paged_decode_cost(
        (rows // len(devices), tokens, heads),
        args[1].shape,
        (rows // len(devices), table_len),
        q_dtype=jnp.bfloat16,
        pool_dtype=jnp.bfloat16,
    )
    assert compiled.cost_analysis()["bytes accessed"] >= cost.bytes_accessed  # the kernel's estimate counted

"""The Pallas TPU kernels for KDA (jaxhybrid/ops/pallas/kda.py) against the references in
jaxhybrid/ops/kda.py.

On the CPU the kernels run in interpret mode (the kernel body as plain JAX over the grid) and equal the
references to TOL = 1e-5 relative (max |a - b| / max |b|) in fp32. The bound holds because both sides do
the same fp32 operations: matmuls at HIGHEST precision, exps of the same direct sums of log-decays (<= 0,
so no exponent overflows or cancels), the same block inverse; only the order of additions differs (the
kernel's masked full-width products against the reference's sliced blocks; the kernel's chunk length), a
few ulps per sum through a chunk's triangular solve, the bound the reference's own chunked and recurrent
forms meet (tests/test_ops_kda.py). The decode kernels do the reference's scan step op for op.

With libtpu installed every kernel also compiles deviceless for TPU topologies (v5e, v6e, tpu7x) inside
`shard_map`, with the models' head dim 128 and the tiny configs' 16: the compiled program holds the Mosaic
custom call, and the pool kernel under donation updates the pool in place (XLA's temporaries smaller than
the pool, the pool aliased to the result).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_ops_kda import make_inputs

from jaxhybrid.ops.kda import kda_chunked, kda_decode_into_pool_reference, kda_recurrent, kda_recurrent_states
from jaxhybrid.ops.pallas.kda import (
    kda_chunked_cost,
    kda_chunked_pallas,
    kda_decode_into_pool_cost,
    kda_decode_into_pool_pallas,
    kda_decode_states_cost,
    kda_decode_states_pallas,
)

TOL = 1e-5
DK, DV = 16, 32  # rectangular: a swapped head dim fails

chunked_pallas = jax.jit(functools.partial(kda_chunked_pallas, interpret=True), static_argnames="chunk")
chunked_ref = jax.jit(kda_chunked, static_argnames="chunk_size")
recurrent_ref = jax.jit(kda_recurrent)
pool_pallas = jax.jit(functools.partial(kda_decode_into_pool_pallas, interpret=True))
pool_ref = jax.jit(kda_decode_into_pool_reference)
states_pallas = jax.jit(functools.partial(kda_decode_states_pallas, interpret=True))
states_ref = jax.jit(kda_recurrent_states)


def errors(got: tuple, want: tuple, label: str) -> dict[str, float]:
    return {f"{label} {name}": rel_err(a, b) for name, a, b in zip(("o", "S"), got, want, strict=True)}


# ----------------------------------------------------------------------------- interpret mode vs references


@settings(max_examples=4, deadline=None)
@given(
    t=st.integers(1, 70),
    chunk=st.sampled_from([16, 32, 64]),
    state=st.booleans(),
    strong=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=32, chunk=16, state=True, strong=True, seed=1)  # T a multiple of the chunk
@example(t=17, chunk=16, state=False, strong=False, seed=2)  # one token past a chunk boundary
def test_chunked_matches_the_references(t: int, chunk: int, state: bool, strong: bool, seed: int) -> None:
    (q, k, v, g, beta), s0 = make_inputs(seed, t, DK, DV, strong=strong, state=state)
    s0 = s0 if state else None
    got = chunked_pallas(q, k, v, g, beta, s0, chunk=chunk)
    o, s = got
    assert o.shape == (2, t, 2, DV) and o.dtype == jnp.float32
    assert s.shape == (2, 2, DK, DV) and s.dtype == jnp.float32
    errs = errors(got, recurrent_ref(q, k, v, g, beta, s0), "vs recurrent")
    errs |= errors(got, chunked_ref(q, k, v, g, beta, s0, chunk_size=chunk), "vs chunked")
    assert max(errs.values()) < TOL, errs


def test_chunked_carries_the_state_across_calls_and_keeps_the_dtype() -> None:
    """Two calls, the second from the first's final state, equal one over the whole sequence (the state's
    contribution to the output); bfloat16 inputs give a bfloat16 output from fp32 arithmetic."""
    (q, k, v, g, beta), _ = make_inputs(11, 40, DK, DV, strong=True)
    whole = chunked_pallas(q, k, v, g, beta, None, chunk=16)
    o1, s1 = chunked_pallas(*(x[:, :23] for x in (q, k, v, g, beta)), None, chunk=16)
    o2, s2 = chunked_pallas(*(x[:, 23:] for x in (q, k, v, g, beta)), s1, chunk=16)
    errs = errors((jnp.concatenate([o1, o2], axis=1), s2), whole, "split")
    assert max(errs.values()) < TOL, errs
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v, g, beta))
    o, s = chunked_pallas(*low, None, chunk=16)
    o_ref, s_ref = recurrent_ref(*low, None)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(s, s_ref) < TOL and rel_err(o, o_ref) < 1e-2  # o rounded once to bfloat16 (2^-8)


def test_chunked_empty_sequence_returns_the_state() -> None:
    (q, k, v, g, beta), s0 = make_inputs(3, 0, DK, DV, state=True)
    o, s = kda_chunked_pallas(q, k, v, g, beta, s0, interpret=True)
    assert o.shape == (2, 0, 2, DV) and np.array_equal(s, s0)


def pool_and_rows(data: st.DataObject, slots: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """A pool of `slots` random fp32 states and the two batch rows' distinct slots, in any order."""
    pool = np.random.default_rng(seed).standard_normal((slots, 2, DK, DV))
    rows = data.draw(st.lists(st.integers(0, slots - 1), min_size=2, max_size=2, unique=True), label="rows")
    return jnp.asarray(pool, jnp.float32), jnp.asarray(rows, jnp.int32)


@settings(max_examples=8, deadline=None)
@given(data=st.data(), slots=st.sampled_from([2, 5]), strong=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_into_pool_matches_the_reference(data, slots: int, strong: bool, seed: int) -> None:
    (q, k, v, g, beta), _ = make_inputs(seed, 1, DK, DV, strong=strong)
    pool, rows = pool_and_rows(data, slots, seed)
    o, new = pool_pallas(q, k, v, g, beta, pool, rows)
    o_ref, new_ref = pool_ref(q, k, v, g, beta, pool, rows)
    assert o.shape == (2, 1, 2, DV) and new.shape == pool.shape and new.dtype == jnp.float32
    untouched = np.setdiff1d(np.arange(slots), np.asarray(rows))
    assert np.array_equal(new[untouched], pool[untouched])
    errs = {"o": rel_err(o, o_ref), "slots": rel_err(new[rows], new_ref[rows])}
    assert max(errs.values()) < TOL, errs


def test_decode_into_pool_under_donation_and_bad_shapes() -> None:
    """Donated, the pool comes back updated (the kernel wrote each row's slot); T != 1 or a pool of other
    heads is refused."""
    (q, k, v, g, beta), _ = make_inputs(4, 1, DK, DV)
    pool = jnp.asarray(np.random.default_rng(4).standard_normal((3, 2, DK, DV)), jnp.float32)
    rows = jnp.asarray([2, 0], jnp.int32)
    _, want = pool_ref(q, k, v, g, beta, pool, rows)
    donating = jax.jit(functools.partial(kda_decode_into_pool_pallas, interpret=True), donate_argnums=5)
    _, new = donating(q, k, v, g, beta, jnp.array(pool), rows)
    assert rel_err(new, want) < TOL
    (q2, k2, v2, g2, beta2), _ = make_inputs(4, 2, DK, DV)
    with pytest.raises(ValueError, match="one token per row"):
        kda_decode_into_pool_pallas(q2, k2, v2, g2, beta2, pool, rows, interpret=True)
    with pytest.raises(ValueError, match="a pool"):
        kda_decode_into_pool_pallas(q, k, v, g, beta, pool[:, :1], rows, interpret=True)


@settings(max_examples=5, deadline=None)
@given(data=st.data(), t=st.integers(1, 4), strong=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_states_matches_the_reference(data, t: int, strong: bool, seed: int) -> None:
    (q, k, v, g, beta), _ = make_inputs(seed, t, DK, DV, strong=strong)
    pool, rows = pool_and_rows(data, 4, seed)
    o, states = states_pallas(q, k, v, g, beta, pool, rows)
    want = states_ref(q, k, v, g, beta, pool[rows])
    assert o.shape == (2, t, 2, DV) and states.shape == (2, t, 2, DK, DV) and states.dtype == jnp.float32
    errs = errors((o, states), want, "vs recurrent_states")
    assert max(errs.values()) < TOL, errs


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 200),
    chunk=st.sampled_from([16, 32, 64]),
    dims=st.sampled_from([(16, 32), (32, 16), (128, 128)]),
    state=st.booleans(),
    strong=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_and_decode_states_match_the_references_wide(t, chunk, dims, state, strong, seed) -> None:
    """More examples, longer T and the models' 128-wide heads, the prefill then a verify step from its
    final state in a pool (slot 1 of 3, the other rows' slots random)."""
    dk, dv = dims
    (q, k, v, g, beta), s0 = make_inputs(seed, t + 3, dk, dv, strong=strong, state=state)
    s0 = s0 if state else None
    prompt, verify = (
        tuple(x[:, :t] for x in (q, k, v, g, beta)),
        tuple(x[:, t:] for x in (q, k, v, g, beta)),
    )
    got = chunked_pallas(*prompt, s0, chunk=chunk)
    errs = errors(got, recurrent_ref(*prompt, s0), "prefill vs recurrent")
    pool = jnp.asarray(np.random.default_rng(seed).standard_normal((3, 2, dk, dv)), jnp.float32)
    pool = pool.at[1].set(got[1][0])
    rows = jnp.asarray([1, 2], jnp.int32)
    errs |= errors(states_pallas(*verify, pool, rows), states_ref(*verify, pool[rows]), "verify vs states")
    assert max(errs.values()) < TOL, errs


# ----------------------------------------------------------------------------- cost estimates


def kernel_counts(fn, *args) -> tuple[int, int]:
    """(flops, transcendentals) of the one pallas_call in fn(*args), counted from its traced kernel body
    times its grid: 2 M N K per matmul, one flop per element of an add, sub or mul shaped like a state
    [DK, DV] (the decode's decay and rank-1 update, the prefill's decay and sum of the state), one
    transcendental per element of an exp."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    flops = exps = 0

    def walk(jx) -> None:
        nonlocal flops, exps
        for e in jx.eqns:
            out = e.outvars[0].aval.shape if e.outvars else ()
            if e.primitive.name == "dot_general":
                (contract, _), _ = e.params["dimension_numbers"]
                flops += 2 * int(np.prod(out)) * int(np.prod([e.invars[0].aval.shape[d] for d in contract]))
            elif e.primitive.name in ("add", "sub", "mul") and out == (DK, DV):
                flops += DK * DV
            elif e.primitive.name == "exp":
                exps += int(np.prod(out))
            for p in e.params.values():
                for sub in p if isinstance(p, tuple) else (p,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(call.params["jaxpr"])
    grid = int(np.prod(call.params["grid_mapping"].grid))
    assert call.params["cost_estimate"] is not None
    return flops * grid, exps * grid


def test_chunked_cost_counts_its_blocks() -> None:
    """Bytes by hand for B=2, T=100, H=3, dk=16, dv=32, chunk 64 (T padded to two chunks, 128), q, k, g
    and beta bfloat16, v float32; flops and exps against the traced kernel (chunk 32: no block shaped like
    a state)."""
    sds = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    q, v, beta = sds((2, 100, 3, DK), bf), sds((2, 100, 3, DV), f32), sds((2, 100, 3), bf)
    cost = kda_chunked_cost(q, q, v, q, beta, chunk=64)
    tokens = 2 * 3 * 128
    by_hand = (
        3 * tokens * DK * 2  # q, k, g: bfloat16 (C, dk) blocks over the padded T
        + tokens * DV * 4  # v
        + tokens * 4  # beta, made fp32 for the kernel
        + 2 * 3 * DK * DV * 4  # the initial state, once per row and head
        + tokens * DV * 4  # o, in v's dtype
        + 2 * 3 * DK * DV * 4  # the final state
    )
    assert cost.bytes_accessed == by_hand == 297984
    for chunk in (32, 64):
        args = (sds((2, 100, 3, DK), f32),) * 2 + (sds((2, 100, 3, DV), f32), sds((2, 100, 3, DK), f32))
        args += (sds((2, 100, 3), f32),)
        est = kda_chunked_cost(*args, chunk=chunk)
        traced = kernel_counts(lambda *a, c=chunk: kda_chunked_pallas(*a, chunk=c), *args)
        assert (est.flops, est.transcendentals) == traced, (chunk, est, traced)


def test_decode_costs_count_their_blocks() -> None:
    """Bytes by hand for B=3 rows of H=2 heads from a pool of 7 fp32 slots (the rest of the pool never
    read), q, k, g bfloat16, v, beta float32; flops and exps against the traced kernels."""
    sds = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    pool, rows = sds((7, 2, DK, DV), f32), sds((3,), jnp.int32)
    for t, cost_fn, kernel in (
        (1, kda_decode_into_pool_cost, kda_decode_into_pool_pallas),
        (3, kda_decode_states_cost, kda_decode_states_pallas),
    ):
        q, v, beta = sds((3, t, 2, DK), bf), sds((3, t, 2, DV), f32), sds((3, t, 2), f32)
        cost = cost_fn(q, q, v, q, beta, pool, rows)
        vectors = 3 * t * 2 * (3 * DK * 2 + DV * 4 + 4) + 3 * 4  # q, k, g, v, beta per row, token, head; rows
        o = 3 * t * 2 * DV * 4
        slots = 3 * 2 * DK * DV * 4  # the rows' slots
        states = 2 * slots if t == 1 else slots + t * slots  # written back, or read once and one per token
        assert cost.bytes_accessed == vectors + o + states, (t, cost)
        traced = kernel_counts(kernel, q, q, v, q, beta, pool, rows)
        assert (cost.flops, cost.transcendentals) == traced, (t, cost, traced)


# ----------------------------------------------------------------------------- deviceless TPU compiles

libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='libtpu is not installed (pip install -e ".[tpu]")'
)


def compile_for(topology: str, kernel: str, dk: int):
    """`kernel` jitted inside shard_map over 4 devices of `topology` (heads split 4 ways, H = 8), bfloat16
    token inputs, compiled for TPU; returns (compiled, per-device pool bytes, the kernel's cost estimate
    for one device's shard)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from serve.engine.topology import topology_devices

    mesh = Mesh(np.array(topology_devices(topology)[:4]), ("x",))
    b, h, dv, slots = 2, 8, dk, 256
    t = {"chunked": 100, "pool": 1, "states": 4}[kernel]
    heads, state = P(None, None, "x"), P(None, "x")

    def sds(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    tokens = [sds((b, t, h, dk), heads), sds((b, t, h, dk), heads), sds((b, t, h, dv), heads)]
    tokens += [sds((b, t, h, dk), heads), sds((b, t, h), heads)]
    local = [jax.ShapeDtypeStruct(x.shape[:2] + (h // 4,) + x.shape[3:], x.dtype) for x in tokens]
    pool = sds((slots, h, dk, dv), state, jnp.float32)
    rows = sds((b,), P(), jnp.int32)
    local_pool = jax.ShapeDtypeStruct((slots, h // 4, dk, dv), jnp.float32)
    if kernel == "chunked":
        fn, args, donate = kda_chunked_pallas, tokens + [sds((b, h, dk, dv), state, jnp.float32)], ()
        specs, out = (heads,) * 5 + (state,), (heads, state)
        cost = kda_chunked_cost(*local)
    elif kernel == "pool":
        fn, args, donate = kda_decode_into_pool_pallas, tokens + [pool, rows], (5,)
        specs, out = (heads,) * 5 + (state, P()), (heads, state)
        cost = kda_decode_into_pool_cost(*local, local_pool, rows)
    else:
        fn, args, donate = kda_decode_states_pallas, tokens + [pool, rows], ()
        specs, out = (heads,) * 5 + (state, P()), (heads, P(None, None, "x"))
        cost = kda_decode_states_cost(*local, local_pool, rows)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
    with jax.default_matmul_precision("default"):  # Mosaic refuses some products under the suite's HIGHEST
        compiled = jax.jit(mapped, donate_argnums=donate).lower(*args).compile()
    return compiled, slots * (h // 4) * dk * dv * 4, cost


def kernel_operands(hlo: str) -> list[str]:
    """The names of the Mosaic custom call's operands in a compiled program's text."""
    (line,) = [x for x in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in x]
    operands = line.split("custom-call(", 1)[1].split(")", 1)[0].split(",")
    return [x.strip().rsplit("*/", 1)[-1] for x in operands]


@libtpu
@pytest.mark.parametrize(
    "topology, kernel, dk",
    [
        ("v5e:2x2", "chunked", 16),
        ("v5e:2x2", "chunked", 128),
        ("v5e:2x2", "pool", 16),
        ("v5e:2x2", "pool", 128),
        ("v5e:2x2", "states", 16),
        ("v5e:2x2", "states", 128),
        ("v6e:2x4", "chunked", 128),
        ("v6e:2x4", "pool", 128),
        ("tpu7x:2x2x4", "chunked", 128),
        ("tpu7x:2x2x4", "states", 128),
    ],
)
def test_kernel_compiles_for_tpu_through_mosaic(topology: str, kernel: str, dk: int) -> None:
    compiled, pool_bytes, cost = compile_for(topology, kernel, dk)
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo
    # XLA takes the kernel's cost estimate: only the kernel exponentiates
    assert compiled.cost_analysis()["transcendentals"] == cost.transcendentals
    if kernel != "chunked" and dk == 128:
        # the kernel reads the pool's own buffer: XLA copies it nowhere first, not even into VMEM (which it
        # does, without counting a temporary, when the kernel writes a result of its own). With 16-wide
        # heads XLA's default TPU layout of the pool puts the slot axis minor, and the pool is converted to
        # the kernel's row-major layout and back around the call.
        assert kernel_operands(hlo)[6].startswith("%param"), kernel_operands(hlo)
    if kernel == "pool":
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= pool_bytes  # the updated pool is the donated one
        assert memory.temp_size_in_bytes < pool_bytes, memory

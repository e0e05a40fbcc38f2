"""Ops choose their form from where the arrays live, not from the host's default backend: the engine's
programs lowered for a TPU on this CPU host hold no CPU kernel and no CPU-only formulation, and the same
traces lowered for the CPU keep the CPU's kernels."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, float32_product_bound
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.ops import native, placement, precision
from serve.engine.config import EngineShape, ProgramShape
from serve.engine.engine import EngineConfig
from serve.engine.runner import Runner

ENGINE = EngineConfig(max_slots=2, block_size=16, prefill_chunk=32, max_model_len=64, prefix=None)
WIDTH = 4  # table width of ENGINE's 64 tokens in blocks of 16
PROGRAMS = [ProgramShape(2, 1, WIDTH), ProgramShape(1, 32, WIDTH), ProgramShape(2, 3, WIDTH, verify=True)]


def lowered_texts(runner: Runner, program: ProgramShape) -> dict[str, str]:
    """`program` traced once from shapes alone (no device in them) and lowered for each platform."""
    _, run, args = runner.compiles._ahead_args(program)
    bare = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    traced = run.trace(*bare)
    return {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "tpu")}


def custom_calls(text: str) -> set[str]:
    return set(re.findall(r"stablehlo\.custom_call @(\w+)", text))


@pytest.fixture(scope="module", params=["tiny", "tiny-int8", "tiny-k3"])
def runner(request):
    name = request.param.removesuffix("-int8")
    model = HybridLM(load_config(name), rngs=nnx.Rngs(0), dtype=jnp.float32)
    if request.param.endswith("-int8"):
        model.to_int8()
    return Runner(model, EngineShape.resolve(ENGINE, model.config))


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: f"{p.rows}x{p.length}{'v' if p.verify else ''}")
def test_a_tpu_program_holds_no_cpu_kernel_and_no_cpu_expert_loop(runner, program):
    texts = lowered_texts(runner, program)
    tpu_calls = {c for c in custom_calls(texts["tpu"]) if c.startswith("jaxhybrid_")}
    assert not tpu_calls, f"CPU kernels in a TPU program: {tpu_calls}"
    # the routed experts as one grouped product (ragged_dot) on the TPU; the CPU's loop over experts in use
    # (or its kernel over (token, expert) pairs) on the CPU
    assert "ragged_dot" in texts["tpu"]
    assert "ragged_dot" not in texts["cpu"]
    if native.f32_kernel() is not None:  # the same trace keeps the CPU kernels where it runs on CPUs
        assert any(c.startswith("jaxhybrid_") for c in custom_calls(texts["cpu"]))


def test_a_bfloat16_product_is_upcast_only_on_the_cpu():
    a = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16)
    traced = jax.jit(lambda a, b: precision.einsum_f32("md,fd->mf", a, b)).trace(a, b)
    dots = {
        p: re.findall(r"stablehlo\.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
        for p in ("cpu", "tpu")
        for text in [traced.lower(lowering_platforms=(p,)).as_text()]
    }
    assert dots["tpu"] == [("tensor<4x8xbf16>", "tensor<16x8xbf16>")]
    assert dots["cpu"] == [("tensor<4x8xf32>", "tensor<16x8xf32>")]
    x = jax.random.normal(jax.random.key(0), (4, 8)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (16, 8)).astype(jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # bf16 products: exact in float32
    bound = float32_product_bound(np.asarray(x, np.float64), np.asarray(w, np.float64))  # float32 sums of 8
    assert_within(precision.einsum_f32("md,fd->mf", x, w), exact, bound)


def test_the_platform_comes_from_the_arrays_or_their_mesh():
    cpu = jax.devices("cpu")[0]
    mesh = Mesh(np.array([cpu]), ("x",))
    on_mesh = jax.device_put(jnp.ones(4), NamedSharding(mesh, PartitionSpec()))
    assert placement.platform_of(jnp.ones(3)) == "cpu"
    assert placement.platform_of(jax.ShapeDtypeStruct((2,), jnp.float32)) is None
    assert placement.platform_of(jax.ShapeDtypeStruct((2,), jnp.float32, sharding=on_mesh.sharding)) == "cpu"
    seen = []

    @jax.jit
    def f(x):
        y = x * 2  # a value computed in the program carries its input's mesh
        seen.append(placement.platform_of(y))
        return placement.by_platform(y, cpu=lambda: y + 1, default=lambda: y - 1)

    np.testing.assert_array_equal(f(on_mesh), 3.0)
    np.testing.assert_array_equal(f(jnp.ones(5)), 3.0)  # unknown while traced: the lowering platform chose
    assert seen == ["cpu", None]


def test_a_known_platform_traces_one_form_only():
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    x = jax.device_put(jnp.ones(4), NamedSharding(mesh, PartitionSpec()))
    traced = []

    def form(name, value):
        traced.append(name)
        return value

    def op(x):
        return placement.by_platform(x, cpu=lambda: form("cpu", x), default=lambda: form("xla", -x))

    jax.jit(op)(x)
    assert traced == ["cpu"]
    traced.clear()
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    text = jax.jit(op).trace(spec).lower(lowering_platforms=("tpu",)).as_text()
    assert sorted(traced) == ["cpu", "xla"] and "negate" in text

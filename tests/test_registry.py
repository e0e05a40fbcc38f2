"""The op registry: every registered implementation that can run on this CPU equals its op's reference; the
kernels mode really changes what a program holds and is part of a compiled program's key; the engine's
greedy tokens are the same under the reference mode as under auto; bad modes are refused clearly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.ops import conv, dense, int8, kda, mla, moe, native, registry, stacks
from jaxhybrid.ops.registry import Kind, Mode
from serve.cli import main
from serve.engine.engine import Engine, EngineConfig
from serve.engine.executables import ExecutableCache
from serve.engine.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# float32 results of the same sums in another order (the kernels split and vectorize them) over a few dozen
# terms of magnitude ~1: each differs by a few ulps of the largest term, so 2e-5 relative (about 150 ulps)
# holds however the order falls, while a wrong row, slot, decay or expert gives differences of order 1
RTOL, ATOL = 2e-5, 2e-5


def _f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _kda_args(rng: np.random.Generator, t: int) -> tuple[Any, ...]:
    """q, k (unit rows), v, g (<= 0), beta in (0, 1), a pool of 4 states and rows 2 and 0 of it."""
    b, h, dk, dv = 2, 2, 8, 8
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(_f32(rng, b, t, h, dk)), unit(_f32(rng, b, t, h, dk))
    g = -jnp.abs(_f32(rng, b, t, h, dk, scale=0.5))
    beta = jax.nn.sigmoid(_f32(rng, b, t, h))
    pool = _f32(rng, 4, h, dk, dv, scale=0.3)
    return (q, k, _f32(rng, b, t, h, dv), g, beta, pool, jnp.array([2, 0], jnp.int32))


def _experts(rng: np.random.Generator, *lead: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    d, f = 8, 6
    return tuple(_f32(rng, *lead, *shape, scale=0.4) for shape in ((f, d), (d, f), (f, d)))


def _routing(rng: np.random.Generator) -> dict[str, Any]:
    """5 tokens, 2 of 4 experts each (one token choosing expert 1 twice), the last token not valid."""
    ids = jnp.array([[0, 3], [1, 1], [2, 0], [3, 2], [1, 0]], jnp.int32)
    weights = jax.nn.softmax(_f32(rng, 5, 2), axis=-1)
    return {"weights": weights, "expert_ids": ids, "valid": jnp.array([True, True, True, True, False])}


def _moe(rng: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    r = _routing(rng)
    return (_f32(rng, 5, 8), *_experts(rng, 4), r["weights"], r["expert_ids"]), {"valid": r["valid"]}


def _moe_stacked(rng: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    r = _routing(rng)
    args = (_f32(rng, 5, 8), *_experts(rng, 2, 4), r["weights"], r["expert_ids"])
    return args, {"group": jnp.int32(1), "valid": r["valid"]}


def _mla(rng: np.random.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """2 rows of 2 new tokens over a pool of 6 blocks of 4 latents; row 1 sees nothing at its first token."""
    h, nope, rope, v, r = 2, 8, 4, 6, 16
    q = _f32(rng, 2, 2, h, nope + rope)
    pool = _f32(rng, 6, 4, r + rope)
    table = jnp.array([[5, 1, 3], [0, 2, 4]], jnp.int32)
    end = jnp.array([[7, 8], [0, 11]], jnp.int32)
    kv_b = _f32(rng, h * (nope + v), r, scale=r**-0.5)
    return (q, pool, table, end, kv_b), {"nope_dim": nope, "v_dim": v, "scale": (nope + rope) ** -0.5}


def _int8(w: jax.Array) -> int8.Int8:
    return int8.quantize(w)


# small float32 arguments of each op, from a seeded generator: (args, kwargs)
EXAMPLES: dict[str, Callable[[np.random.Generator], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "kda_decode": lambda rng: (_kda_args(rng, 1), {}),
    "kda_decode_into_pool": lambda rng: (_kda_args(rng, 1), {}),
    "kda_decode_states": lambda rng: (_kda_args(rng, 3), {}),
    "causal_conv1d_into_pool": lambda rng: (
        (_f32(rng, 2, 1, 8), _f32(rng, 8, 4), _f32(rng, 4, 8, 3), jnp.array([3, 1], jnp.int32)),
        {"lengths": jnp.array([1, 0], jnp.int32)},  # row 1 has no valid token: its window stays
    ),
    "set_rows": lambda rng: ((_f32(rng, 5, 3, 4), jnp.array([4, 1], jnp.int32), _f32(rng, 2, 3, 4)), {}),
    "mla_attention_paged": _mla,
    "moe_experts_dropless": _moe,
    "moe_experts_dropless_stacked": _moe_stacked,
    "dense.matmul": lambda rng: ((_f32(rng, 3, 8), _f32(rng, 2, 4, 6, 8), (1, 2)), {}),
    "dense.matmul_many": lambda rng: ((_f32(rng, 2, 8), [_f32(rng, 6, 8), _f32(rng, 5, 8)]), {}),
    "dense.matmul_pairs_many": lambda rng: (
        (_f32(rng, 4, 8), [_f32(rng, 3, 6, 8), _f32(rng, 3, 5, 8)], jnp.array([0, 2, -1, 1], jnp.int32)),
        {},
    ),
    "int8.matmul": lambda rng: ((_f32(rng, 3, 8), _int8(_f32(rng, 2, 6, 8)), 1), {}),
    "int8.matmul_many": lambda rng: ((_f32(rng, 2, 8), [_int8(_f32(rng, 6, 8)), _int8(_f32(rng, 5, 8))]), {}),
    "int8.matmul_pairs_many": lambda rng: (
        (_f32(rng, 4, 8), [_int8(_f32(rng, 3, 6, 8))], jnp.array([2, -1, 0, 2], jnp.int32)),
        {},
    ),
}


def _kernels_built() -> bool:
    return native.f32_kernel() is not None


@pytest.mark.parametrize("impl", registry.implementations(), ids=lambda i: i.name)
def test_every_implementation_equals_its_ops_reference(impl: registry.Implementation) -> None:
    """Each implementation on its op's example (a Pallas kernel interpreted) against the reference, float32,
    to `RTOL`/`ATOL`; a native one where the kernels are built here (they build with a C++ compiler)."""
    args, kwargs = EXAMPLES[impl.op](np.random.default_rng(7))
    if impl.kind is Kind.NATIVE and not _kernels_built():
        pytest.skip("the native kernels are not built here")
    assert impl.applies(*args, **kwargs), f"the example of {impl.op} does not meet {impl.name}'s predicate"
    run = impl.bound("cpu")  # the CPU runs XLA forms for any platform; a Pallas kernel interpreted
    got = jax.tree.leaves(run(*args, **kwargs))
    want = jax.tree.leaves(registry.op(impl.op).reference.fn(*args, **kwargs))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_every_op_has_a_reference_and_an_example() -> None:
    """The ops of the modules that declare some (imported here) are those with an example, each with one
    reference, first; each public function is its Op."""
    ops = {i.op for i in registry.implementations()}
    assert ops == set(EXAMPLES)
    for name in ops:
        kinds = [i.kind for i in registry.op(name).implementations]
        assert kinds[0] is Kind.REFERENCE and kinds.count(Kind.REFERENCE) == 1
    declared = (conv.CAUSAL_CONV1D_INTO_POOL, dense.MATMUL, int8.MATMUL, mla.MLA_ATTENTION_PAGED)
    declared += (moe.MOE_EXPERTS_DROPLESS, stacks.SET_ROWS, kda.KDA_DECODE)
    assert all(registry.op(o.name) is o for o in declared)


def _custom_calls(text: str) -> set[str]:
    return {c for c in re.findall(r"stablehlo\.custom_call @(\w+)", text) if c.startswith("jaxhybrid_")}


@pytest.mark.skipif(not _kernels_built(), reason="the native kernels are not built here")
def test_the_mode_changes_what_a_program_holds_and_the_op_still_agrees() -> None:
    """The same jitted op on CPU arrays: under auto its program calls the native kernel, under reference and
    xla it holds no CPU custom call (the mode is part of jit's key: no trace is reused across modes)."""
    args = _kda_args(np.random.default_rng(1), 1)
    step = jax.jit(kda.kda_decode_into_pool)
    texts, outs = {}, {}
    for mode in (Mode.AUTO, Mode.REFERENCE, Mode.XLA, Mode.PALLAS, Mode.AUTO):
        with registry.kernels(mode):
            texts[mode] = step.lower(*args).as_text()
            outs[mode] = step(*args)
    assert _custom_calls(texts[Mode.AUTO]) == {native.KDA_POOL_TARGET}
    assert not _custom_calls(texts[Mode.REFERENCE]) and not _custom_calls(texts[Mode.XLA])
    assert not _custom_calls(texts[Mode.PALLAS])  # no Pallas entry yet: xla, then the reference
    for mode in (Mode.REFERENCE, Mode.XLA):
        for a, b in zip(outs[mode], outs[Mode.AUTO], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_a_program_traced_from_shapes_alone_takes_each_platforms_choice_at_lowering() -> None:
    """No device in the arguments: under auto the CPU lowering holds the kernel (where built) and the TPU one
    none; under reference neither does."""
    shapes = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    args = jax.tree.map(shapes, _kda_args(np.random.default_rng(2), 1))
    for mode, cpu_calls in ((Mode.AUTO, _kernels_built()), (Mode.REFERENCE, False)):
        with registry.kernels(mode):
            traced = jax.jit(kda.kda_decode_into_pool).trace(*args)
            cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
            tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
        assert bool(_custom_calls(cpu)) == cpu_calls
        assert not _custom_calls(tpu)


def test_a_registered_pallas_kernel_runs_interpreted_under_pallas_and_compiled_only_on_its_platform(
    monkeypatch,
) -> None:
    """A stand-in Pallas entry for the TPU (it records how it was called): auto on CPU arrays runs the
    reference; pallas runs it interpreted; traced from shapes alone under auto, the TPU lowering holds it
    compiled and the CPU lowering the reference (it gives 3x, the reference 2x: told apart in the text)."""
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))  # the stand-in op leaves with the test
    calls = []

    def triple(x: jax.Array, *, interpret: bool = False) -> jax.Array:
        calls.append(interpret)
        return x * 3.0

    op = registry.Op("stand_in", lambda x: x * 2.0)
    op.register(registry.Implementation(Kind.PALLAS, triple, registry.TPU))
    assert [i.name for i in registry.implementations() if i.op == "stand_in"][1] == "stand_in:pallas:triple"
    x = jnp.ones((2,), jnp.float32)
    with registry.kernels(Mode.AUTO):
        np.testing.assert_array_equal(op(x), 2.0)
    with registry.kernels(Mode.PALLAS):
        np.testing.assert_array_equal(op(x), 3.0)
    assert calls == [True]
    with registry.kernels(Mode.AUTO):
        traced = jax.jit(op).trace(jax.ShapeDtypeStruct((2,), jnp.float32))
        cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
        tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert calls == [True, False]
    assert "2.000000e+00" in cpu and "3.000000e+00" not in cpu
    assert "3.000000e+00" in tpu and "2.000000e+00" not in tpu
    with pytest.raises(ValueError, match="one reference"):
        op.register(registry.Implementation(Kind.REFERENCE, triple))


def test_the_kernels_mode_is_part_of_a_compiled_programs_key(tmp_path) -> None:
    """A program compiled under one mode holds other implementations than under another: never the same
    entry of the compiled-program cache."""
    cache, args = ExecutableCache(tmp_path), (jnp.zeros((2, 3), jnp.float32),)
    keys = {}
    for mode in Mode:
        with registry.kernels(mode):
            keys[mode] = cache.key("run", "structure", args)
            assert keys[mode] == cache.key("run", "structure", args)
    assert len(set(keys.values())) == len(Mode)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


# tiny-k3 (MXFP4 experts, attention residuals) takes two minutes here: with the slow tests
@pytest.mark.parametrize("config", ["tiny", pytest.param("tiny-k3", marks=pytest.mark.slow)])
def test_the_engines_greedy_tokens_are_the_same_under_the_reference_mode(config: str) -> None:
    """The engine on one short and one chunked prompt, under reference (every op its plain JAX reference:
    the dense experts, the gathered MLA view, XLA's scatters into the pools) and under auto."""
    model = HybridLM(load_config(config), rngs=nnx.Rngs(0), dtype=jnp.float32)
    prompts = [[5, 9, 17, 3, 44], list(range(3, 40))]
    tokens = {}
    for mode in (Mode.REFERENCE, Mode.AUTO):
        with registry.kernels(mode):
            eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=16, prefix=None))
            ids = [eng.add_request(p, GREEDY) for p in prompts]
            while eng.has_unfinished():
                eng.step()
            tokens[mode] = [eng.result(i).token_ids for i in ids]
    assert tokens[Mode.REFERENCE] == tokens[Mode.AUTO]
    assert all(len(t) == GREEDY.max_tokens for t in tokens[Mode.AUTO])


def test_a_bad_mode_is_refused_with_the_choices() -> None:
    choices = r"\$JAXHYBRID_KERNELS='fast': the kernels mode is one of auto, reference, xla, pallas"
    with pytest.raises(registry.KernelsError, match=choices):
        registry.from_env({registry.ENV: "fast"})
    assert registry.from_env({}) is Mode.AUTO and registry.from_env({registry.ENV: "xla"}) is Mode.XLA
    with pytest.raises(registry.KernelsError, match="--kernels='fast'"):
        registry.set_mode("fast")


def test_a_bad_env_var_fails_the_first_op_not_the_import() -> None:
    """$JAXHYBRID_KERNELS=fast: importing works, the first op raises the message; =reference: every op its
    reference."""
    code = (
        "import jax.numpy as jnp\n"
        "from jaxhybrid.ops import registry, stacks\n"
        "print(registry.mode().value)\n"
        "stacks.set_rows(jnp.zeros((3, 2)), jnp.array([1]), jnp.ones((1, 2)))\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    bad = subprocess.run([sys.executable, "-c", code], env=env | {registry.ENV: "fast"}, capture_output=True)
    assert bad.returncode != 0
    assert b"KernelsError: $JAXHYBRID_KERNELS='fast': the kernels mode is one of" in bad.stderr
    good_env = env | {registry.ENV: "reference"}
    good = subprocess.run([sys.executable, "-c", code], env=good_env, capture_output=True)
    assert good.returncode == 0 and good.stdout.split() == [b"reference"], good.stderr[-2000:]


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_the_cli_refuses_a_bad_kernels_flag_with_exit_2(command: str, capsys) -> None:
    with registry.kernels(Mode.AUTO), pytest.raises(SystemExit) as exit_:
        main([command, "--kernels", "fast"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--kernels: invalid choice: 'fast'" in err and "Traceback" not in err


def test_the_cli_refuses_a_bad_env_var_with_exit_2_and_sets_the_flags_mode(capsys, monkeypatch) -> None:
    before = registry.mode()
    monkeypatch.setenv(registry.ENV, "fast")
    with registry.kernels(Mode.AUTO), pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", "tiny"])
    assert exit_.value.code == 2 and "$JAXHYBRID_KERNELS='fast'" in capsys.readouterr().err
    monkeypatch.delenv(registry.ENV)
    with registry.kernels(Mode.AUTO):
        plan = ["plan", "--config", "tiny", "--kernels", "reference", "--chips", "1", "--hbm", "16"]
        assert main(plan) == 0
        assert registry.mode() is Mode.REFERENCE
    assert registry.mode() is before  # the block restored the mode before it

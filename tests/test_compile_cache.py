"""The engine's compiled model programs: a short first request's set of programs, and programs read back from
the compile cache's serialized executables without tracing the model (an entry that cannot be read is
compiled again), giving what a fresh compile gives."""

import collections
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from flax import nnx

import serve.engine.runner as runner_mod
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine import executables
from serve.engine.config import EngineShape, ProgramShape
from serve.engine.engine import Engine, EngineConfig
from serve.engine.executables import ExecutableCache
from serve.engine.runner import Runner
from serve.engine.sampling import SamplingParams

RUN_FN, PROGRAMS = runner_mod._run_fn, runner_mod._programs.__wrapped__  # the model function; uncached
SMALL = EngineConfig(max_slots=1, block_size=8, prefill_chunk=16, max_model_len=64, prefix=None)
DECODE = ProgramShape(1, 1, 8)  # the one table width of SMALL (64 tokens)


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


def test_a_short_first_request_needs_one_prefill_and_one_decode_program(model):
    """The README's curl ("Hello", 16 tokens) with the default block size: its prompt and answer fit the
    narrowest block table (64 tokens), so it meets the 16-token prefill and the one-row decode step at that
    width, nothing else (it used to meet a decode step per table of 1 and 2 blocks as well)."""
    eng = Engine(model, EngineConfig())
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    width = eng.shape.table_buckets[0]
    assert width * eng.shape.block_size == 64
    assert eng.compiled_programs() == {ProgramShape(1, 16, width), ProgramShape(1, 1, width)}


def counting_runner(model, cache, monkeypatch):
    """A new Runner whose model function counts its traces (its own jitted programs, not shared ones, and
    none of the programs this process already read or kept)."""
    traces = []

    def counting(*a):
        fn = RUN_FN(*a)

        def run(*args):
            traces.append(1)
            return fn(*args)

        return run

    monkeypatch.setattr(runner_mod, "_run_fn", counting)
    monkeypatch.setattr(runner_mod, "_programs", PROGRAMS)
    monkeypatch.setattr(ExecutableCache, "from_jax_config", classmethod(lambda cls: cache))
    monkeypatch.setattr(executables, "_SLOTS", collections.OrderedDict())  # as in a new process: disk only
    jax.clear_caches()  # and none of the executables jit keeps in memory (some came from JAX's disk cache)
    return Runner(model, EngineShape.resolve(SMALL, model.config)), traces


def decode_once(runner):
    """One decode step of slot 0 at position 3 over a table of blocks 1..: logits and the pools after."""
    tables = np.full((1, DECODE.width), 0, np.int32)
    tables[0, 0] = 1
    logits = runner.run_program(np.array([[9]]), np.array([0]), tables, np.array([3]), np.array([1])).logits
    return np.asarray(logits), [np.asarray(x) for x in jax.tree.leaves(runner.pools)]


def test_a_cached_program_runs_without_tracing_the_model(model, tmp_path, monkeypatch):
    """A new runner (its own jitted functions, as in a new process) reads the decode program that another
    compiled from the cache without tracing the model, and its step equals the compiled one's, logits and
    pools bit for bit; other weights of the same structure run it too; a corrupt entry is compiled again."""
    cache = ExecutableCache(tmp_path)
    fresh, fresh_traces = counting_runner(model, cache, monkeypatch)
    assert fresh.compile_program(DECODE)
    assert fresh_traces and list(tmp_path.glob("*.pkl"))  # compiled (traced) and kept
    expected = decode_once(fresh)

    loaded, traces = counting_runner(model, ExecutableCache(tmp_path), monkeypatch)
    got = decode_once(loaded)
    assert traces == []  # read from the cache: the model function was never traced
    assert loaded.compiled_programs() == {DECODE}
    np.testing.assert_array_equal(got[0], expected[0])
    for a, b in zip(got[1], expected[1], strict=True):
        np.testing.assert_array_equal(a, b)

    # the weights are arguments: a model of the same structure with other weights runs the same executable
    other = HybridLM(load_config("tiny"), rngs=nnx.Rngs(1), dtype=jnp.float32)
    loaded, traces = counting_runner(other, ExecutableCache(tmp_path), monkeypatch)
    assert not np.array_equal(decode_once(loaded)[0], expected[0]) and traces == []

    for entry in tmp_path.glob("*.pkl"):  # a torn or corrupt entry: compiled again, same answer
        entry.write_bytes(entry.read_bytes()[:100])
    again, traces = counting_runner(model, ExecutableCache(tmp_path), monkeypatch)
    got = decode_once(again)
    assert traces
    np.testing.assert_array_equal(got[0], expected[0])


KEEP_AFTER_JAX_CACHE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.config import EngineShape
from serve.engine.executables import ExecutableCache
from serve.engine.runner import Runner
from tests.test_compile_cache import SMALL, decode_once
cache_dir, phase = sys.argv[1], sys.argv[2]
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", cache_dir + "/xla")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
cache = ExecutableCache(None if phase == "jax" else __import__("pathlib").Path(cache_dir) / "executables")
ExecutableCache.from_jax_config = classmethod(lambda cls: cache)
model = HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)
np.save(f"{cache_dir}/{phase}.npy", decode_once(Runner(model, EngineShape.resolve(SMALL, model.config)))[0])
"""


def run_script(script: str, *argv: str) -> str:
    """`script` in a fresh process (JAX opens its cache once per process) from the repository: its stdout."""
    root = Path(__file__).resolve().parents[1]
    # the tests' own modules import their siblings by name (`bounds`), as pytest puts tests/ on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, "-c", script, *argv]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_program_kept_after_jax_cache_gave_it_back_runs(tmp_path):
    """Three starts, as a server's: the first compiles the decode program into JAX's persistent cache only,
    the second keeps it as a serialized executable (JAX's cache holds it), the third reads that and runs it.
    On XLA:CPU an executable read back from JAX's cache serializes without its kernels: the third start failed
    at its first step (NOT_FOUND: Function ... not found). Oracle: the first start's logits, bit for bit."""
    for phase in ("jax", "keep", "read"):
        run_script(KEEP_AFTER_JAX_CACHE, str(tmp_path), phase)
    assert list((tmp_path / "executables").glob("*.pkl"))
    np.testing.assert_array_equal(np.load(tmp_path / "read.npy"), np.load(tmp_path / "jax.npy"))


def test_tiered_compile_serves_the_full_pass_quick_first_then_optimized(model, monkeypatch):
    """With the tiered compile a first request waits for the quick tier only: its short prompt runs through
    the one-row decode program (compiled quick) while the prefill program compiles in the background, and
    the decode step's optimized form replaces the quick one when ready. Oracle: the full causal pass, greedy
    tokens and logprobs within tests/oracles.py's `logprob_bounds`, before and after the swap; every program
    ends optimized."""
    from oracles import FullPass, assert_matches_full_pass

    monkeypatch.setattr(executables, "_SLOTS", collections.OrderedDict())  # nothing compiled in this process
    compiles = []
    install = executables.ModelExecutables._install

    def recording(self, slot, lowered, tier):
        install(self, slot, lowered, tier)
        compiles.append(((slot.program.rows, slot.program.length), tier, True))

    monkeypatch.setattr(executables.ModelExecutables, "_install", recording)
    eng = Engine(model, dataclasses.replace(SMALL, tiered_compile=True))
    full, greedy = FullPass(model), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    (first,) = eng.generate([prompt], greedy)
    assert_matches_full_pass(full, prompt, first.token_ids, first.logprobs)
    quick = ((1, 1), executables.Tier.QUICK, True)
    assert quick in compiles  # the decode step, quick, ran the prompt
    executables.BACKGROUND.submit(lambda: None).result(timeout=300)  # the background compiles are done
    prefill, decode = ProgramShape(1, 16, DECODE.width), DECODE
    assert ((1, 16), executables.Tier.OPTIMIZED, True) in compiles  # the prefill program, in the background
    optimized = ((1, 1), executables.Tier.OPTIMIZED, True)  # the decode step's optimized form, after
    assert compiles.index(optimized) > compiles.index(quick)
    assert eng.runner.compiles.optimized() == {prefill, decode}
    for p in (prompt, list(range(20, 40))):  # the prefill program now; a prompt of two chunks
        (out,) = eng.generate([p], greedy)
        assert_matches_full_pass(full, p, out.token_ids, out.logprobs)


def test_a_background_compile_of_a_program_compiling_elsewhere_waits_there_not_on_the_callers_thread():
    """The warm-up asks for a program that a request's step is compiling: the caller (the engine's thread)
    gets a future at once instead of blocking on the compile in progress; it ends, False, when that one
    does."""
    ex = executables.ModelExecutables(None, lambda: "structure", ExecutableCache(None), tiered=True)
    args = (jnp.zeros((2,), jnp.float32),)
    slot = ex._slot(DECODE, "run", args)
    with slot.lock:  # a compile in progress on another thread
        job = ex.compile(DECODE, "run", None, args, executables.Tier.OPTIMIZED, background=True)
        assert not job.done()
    assert job.result(timeout=60) is False


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion options")
def test_one_row_decode_programs_compile_without_xnnpack_fusions_and_others_with_them(model, monkeypatch):
    """A one-row decode step's products and reductions compile without XLA:CPU's XNNPACK fusions
    (`executables.DECODE_OPTIONS`); a decode step of two rows and a prefill chunk keep them (without them a
    few rows times a weight stored [out, in] ran ~100x slower); the programs give the same logits as the
    unfused full causal pass within two fp32 evaluations' bound (`bounds.float32_network_bound`: the options
    change how, not what, is computed)."""
    monkeypatch.setattr(executables, "_SLOTS", collections.OrderedDict())
    runner = Runner(model, EngineShape.resolve(SMALL, model.config))

    def compiled_text(program):
        name, run, args = runner.compiles._ahead_args(program)
        return runner.compiles.executables.get(program, name, run, args)[0].as_text()

    prefill = ProgramShape(1, SMALL.prefill_chunk, DECODE.width)
    if "__ynn_fusion" not in compiled_text(prefill):  # the oracle: XLA's default fuses here
        pytest.skip("this XLA:CPU emits no XNNPACK fusions on this machine")
    assert "__ynn_fusion" not in compiled_text(DECODE)
    assert "__ynn_fusion" in compiled_text(ProgramShape(2, 1, DECODE.width))

    tokens = np.array([[5, 9, 2, 7]], np.int32)
    want = np.asarray(model(jnp.asarray(tokens)))[0]
    tables = np.zeros((1, DECODE.width), np.int32)
    tables[0, 0] = 1
    for i, t in enumerate(tokens[0]):
        got = runner.run_program(np.array([[t]]), np.array([0]), tables, np.array([i]), np.array([1])).logits
        bound = float32_network_bound(model.config, len(tokens[0])) * np.abs(want[i]).max()
        np.testing.assert_allclose(np.asarray(got)[0], want[i], rtol=0, atol=bound)


def test_a_programs_cpu_compile_options_follow_where_its_arguments_live():
    """XLA:CPU's options (the one-row decode step without XNNPACK fusions, the quick tier's elemental
    emitters) only where a program's arguments live on CPUs: one for a TPU, traced on this CPU host, gets
    none, whatever the host's default backend."""
    optimized, quick = executables.Tier.OPTIMIZED, executables.Tier.QUICK
    assert executables.program_options(DECODE, optimized, "cpu") == executables.DECODE_OPTIONS
    assert executables.program_options(DECODE, optimized, "tpu") is None
    assert executables.program_options(ProgramShape(2, 1, DECODE.width), optimized, "cpu") is None
    assert executables.program_options(DECODE, quick, "tpu") == {"xla_backend_optimization_level": 0}
    assert executables.program_options(DECODE, quick, "cpu") == {
        "xla_backend_optimization_level": 0,
        "xla_cpu_use_fusion_emitters": False,
        **executables.DECODE_OPTIONS,
    }


def test_the_products_precision_is_part_of_a_programs_key(tmp_path):
    """A program traced under JAX's default precision "highest" (what the test suite sets, or a user's
    $JAX_DEFAULT_MATMUL_PRECISION) and one traced under the backend's default are different programs on an
    accelerator: they never share an entry."""
    cache, args = ExecutableCache(tmp_path), (jnp.zeros((2, 3), jnp.float32),)
    with jax.default_matmul_precision("highest"):
        highest, again = cache.key("run", "structure", args), cache.key("run", "structure", args)
    with jax.default_matmul_precision("default"):
        default = cache.key("run", "structure", args)
    assert highest == again and highest != default


def test_xla_flags_and_the_native_kernels_source_are_part_of_a_programs_key(tmp_path, monkeypatch):
    """A program compiled under other $XLA_FLAGS (how XLA compiles it) is another entry, and so is one whose
    native kernel's C++ changed (a program calls the kernel by name): neither is loaded for the other."""
    cache, args = ExecutableCache(tmp_path), (jnp.zeros((2, 3), jnp.float32),)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=1")
    one, again = cache.key("run", "structure", args), cache.key("run", "structure", args)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    assert one == again != cache.key("run", "structure", args)
    kernel = tmp_path / "jaxhybrid" / "ops" / "native" / "kernel.cc"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("int f() { return 1; }")
    before = executables.source_digest(tmp_path)
    kernel.write_text("int f() { return 2; }")
    assert executables.source_digest(tmp_path) != before


SERVED_BY_JAX_CACHE = """
import sys
import jax, jax.numpy as jnp
from pathlib import Path
from serve.engine.executables import ExecutableCache, compiled_here
jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/xla")  # shared by both runs
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
def f(x, i):
    y = jnp.exp(x) * 2 + jnp.take(x, i, axis=0).sum()
    return jnp.where(y > 3, y, -y)
x, i = jnp.ones((16, 8)), jnp.array([1, 3])
with compiled_here(keep=False) as compiled:
    program = jax.jit(f).lower(x, i).compile()
cache = ExecutableCache(Path(sys.argv[1]) / sys.argv[2])
kept = cache.save("entry", (program,))
# written anyway, by hand, as the engine's old format did: the next read must refuse it, not load it
import hashlib, pickle
from jax.experimental import serialize_executable
from serve.engine.executables import FORMAT
payload = pickle.dumps(((*serialize_executable.serialize(program), [jax.devices()[0].id]),))
entry = {"format": FORMAT, "digest": hashlib.sha256(payload).hexdigest(), "payload": payload}
(Path(sys.argv[1]) / "forced").mkdir(exist_ok=True)
(Path(sys.argv[1]) / "forced" / "entry.pkl").write_bytes(pickle.dumps(entry))
loaded = ExecutableCache(Path(sys.argv[1]) / "forced").load("entry")
runs = loaded is not None and float(loaded[0](x, i).sum()) == float(jax.jit(f)(x, i).sum())
print(compiled.here, kept, runs)
"""


def test_a_program_served_by_jax_cache_is_seen_and_an_entry_that_cannot_run_is_neither_written_nor_read(
    tmp_path,
):
    """Two processes compile one program with JAX's persistent cache on: the first compiles it (XLA's own:
    `compiled_here` says so, the entry is kept, and one written by hand loads and computes what jit does),
    the second is served by JAX's cache (seen), and on XLA:CPU that executable serializes without its
    kernels: `save` keeps nothing rather than an entry that would fail at the next process's first call,
    and the same bytes written by hand are refused at load (compiled again) instead of run."""
    outs = [run_script(SERVED_BY_JAX_CACHE, str(tmp_path), run).split() for run in ("first", "second")]
    assert outs[0] == ["True", "True", "True"] and (tmp_path / "first" / "entry.pkl").exists()
    assert outs[1][0] == "False"  # JAX's cache served it
    if jax.default_backend() == "cpu":
        assert outs[1][1:] == ["False", "False"] and not (tmp_path / "second").exists()


def test_a_step_that_waits_for_a_program_compiling_elsewhere_says_so_and_for_how_long(caplog):
    """The first request of a server can wait behind the warm-up's compile of the program it needs: when it
    goes on, the step logs for how long and why (a request waited 14.8 s with no line)."""
    import logging
    import threading
    import time

    ex = executables.ModelExecutables(None, lambda: "structure", ExecutableCache(None), tiered=True)
    args = (jnp.zeros((2,), jnp.float32),)
    slot = ex._slot(DECODE, "run", args)
    slot.lock.acquire()  # a compile in progress on another thread, done 0.6 s later

    def finish():
        time.sleep(0.6)
        slot.best = ("program", "write")
        slot.lock.release()

    finisher = threading.Thread(target=finish)
    with caplog.at_level(logging.INFO, logger="jaxhybrid.compile"):
        finisher.start()
        assert ex.get(DECODE, "run", None, args) == ("program", "write")
    finisher.join()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "jaxhybrid.compile"]
    waited = float(line.split("waited ")[1].split(" s")[0])
    assert waited >= 0.5 and line.endswith("(compiling on another thread)")

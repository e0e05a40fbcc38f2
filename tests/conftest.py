"""Test-wide settings: fp32 matmuls at full precision so numerical comparisons are meaningful."""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

# Multi-device tests need simulated CPU devices; set before jax is imported anywhere. Most of the suite's
# time is XLA:CPU compiling tiny models' programs, and LLVM's optimization is much of a compile: the tests
# compile at level 0 (the same HLO, fp32 arithmetic without fast-math; only the machine code is slower), a
# quarter less time, and with XLA:CPU's older elemental emitters instead of its MLIR fusion emitters (a
# third less again at level 0; at the default level they cost more, so only the tests use them).
# JAXHYBRID_TEST_OPT_LEVEL=default runs them on the programs `serve` compiles.
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_flags = [f"{DEVICE_COUNT_FLAG}=8"]
_level = os.environ.get("JAXHYBRID_TEST_OPT_LEVEL", "0")
if _level != "default":
    _flags.append(f"--xla_backend_optimization_level={int(_level)}")
    _flags.append("--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(_flags))
# With libtpu installed (the `tpu` extra: compiling for TPU topologies, tests/test_topology.py) JAX would try
# to open a TPU at every start, and log why it cannot: the tests run on the CPU, and describe TPU topologies
# without opening one. One process at a time may load libtpu unless told otherwise (two test workers).
if importlib.util.find_spec("libtpu") is not None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# `serve` and `generate` keep compiled programs in the user's cache directory (`--compile-cache`): every
# server and command the tests start uses one of this run instead, removed at the end. The run's processes
# (pytest-xdist's workers inherit the controller's environment) share it, and the tests' own programs go
# there too: most of the suite's time is XLA compiling, and many tests compile the same programs.
if "JAXHYBRID_TEST_CACHE_HOME" not in os.environ:
    os.environ["JAXHYBRID_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxhybrid-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXHYBRID_TEST_CACHE_HOME"], True)
os.environ["XDG_CACHE_HOME"] = os.environ["JAXHYBRID_TEST_CACHE_HOME"]
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if os.environ.get("JAXHYBRID_TEST_COMPILE_CACHE") != "off":  # off: compile every program (to compare)
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XDG_CACHE_HOME"], "tests-xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    # The tests' own engines keep no serialized executables (JAX's cache above is enough for them, and the
    # servers and commands they start keep theirs); tests of that cache give their runners one of their own.
    from serve.engine.executables import ExecutableCache  # noqa: E402

    ExecutableCache.from_jax_config = classmethod(lambda cls: cls(None))


def subprocess_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: this run's flags (the optimization level) with the subprocess's own
    simulated device count (None: the one real CPU device)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(kept + ([f"{DEVICE_COUNT_FLAG}={devices}"] if devices else []))


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# XLA:CPU maps memory for every executable it keeps. The whole suite in one process passes the kernel's limit
# (vm.max_map_count, 65530 by default) and a later compilation crashes (a segfault or an abort).
_MAX_MAPPINGS = 30_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # no /proc: clear after every module instead
        return _MAX_MAPPINGS


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After a test module, drop every compiled program once the process holds many mappings (keeping them
    until then: later modules reuse the same programs)."""
    yield
    if _mappings() < _MAX_MAPPINGS:
        return
    from serve.engine.executables import forget_loaded
    from serve.engine.runner import _programs

    _programs.cache_clear()
    forget_loaded()
    jax.clear_caches()
    gc.collect()


# pytest-xdist hands out whole files (`--dist loadfile`) in collection order (`--no-loadscope-reorder`: by
# default it orders them by their number of tests), so a heavy file handed out last leaves one worker running
# it alone at the end. The files of half a minute or more in the default run are collected first, heaviest
# first; the rest (each under half a minute) keep their order.
HEAVY_FIRST = (
    "test_restarts.py",
    "test_prefix_store.py",
    "test_restarts_bench.py",
    "test_topology.py",
    "test_engine.py",
    "test_model.py",
    "test_bench.py",
    "test_server.py",
    "test_train.py",
    "test_packed_model.py",
    "test_sharded_model.py",
    "test_k3_model.py",
    "test_prefix_simulate.py",
    "test_compile_cache.py",
    "test_cli_generate.py",
    "test_prefix_disk.py",
    "test_k3_tokenizer.py",
    "test_prefix_adaptive.py",
    "test_engine_faults.py",
    "test_ops_kda.py",
    "test_bench_quant.py",
    "test_sharded_engine.py",
    "test_weights.py",
    "test_packed_memory.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest keep order

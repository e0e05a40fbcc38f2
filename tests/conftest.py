"""Test-wide settings: fp32 matmuls at full precision so numerical comparisons are meaningful."""

import gc
import os
import tempfile

# Multi-device tests need simulated CPU devices; set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run: modules compile many of the same programs (tiny's
# engine shapes), and the caches are cleared after each module (below). Subprocess tests set their own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxhybrid-test-cache-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float64."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps memory for each executable it
    keeps; the whole suite in one process otherwise passes the kernel's limit of 65530 mappings
    (vm.max_map_count) and a later compilation crashes."""
    yield
    from serve.engine.runner import _programs

    _programs.cache_clear()
    jax.clear_caches()
    gc.collect()

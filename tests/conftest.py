"""Test-wide settings: fp32 matmuls at full precision so numerical comparisons are meaningful."""

import os

# Multi-device tests need simulated CPU devices; set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float64."""
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

"""The precision a matrix product asks for: float32 operands multiply at float32 precision on every backend.

JAX leaves a product's precision to the backend by default, and a GPU then multiplies float32 operands in
TF32 and a TPU in one bfloat16 pass (on an H200 that changed `small`'s greedy tokens against transformers':
BENCHMARKS.md, "On a GPU"). The CPU multiplies float32 at float32 either way. Products of bfloat16 operands
keep the backend's default, which is what serving them in bfloat16 is for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def of(*operands: jax.Array) -> jax.lax.Precision | None:
    """HIGHEST when every operand is float32, else None (the backend's default). Pass a weight as stored,
    before any cast to the activations' dtype: bfloat16 weights multiply at the backend's default."""
    return jax.lax.Precision.HIGHEST if all(x.dtype == jnp.float32 for x in operands) else None

"""The precision a matrix product asks for: float32 operands multiply at float32 precision on every backend;
and the operands XLA:CPU takes for a product that accumulates in float32.

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


def f32_operands(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Operands for a float32-accumulating product, upcast from bf16/f16 on the CPU backend only.

    XLA:CPU's DotThunk rejects some BF16 x BF16 -> F32 dots ("Unsupported element type"). The upcast is
    exact (a bf16 product fits in f32), so CPU results match what accelerators compute natively. Take
    `of` from the operands before this upcast."""
    if jax.default_backend() != "cpu":
        return arrays
    return tuple(a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a for a in arrays)

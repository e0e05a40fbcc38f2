"""The precision a matrix product asks for: float32 operands multiply at float32 precision on every backend;
and a product that accumulates in float32 with operands XLA:CPU takes.

JAX leaves a product's precision to the backend by default, and a GPU then multiplies float32 operands in
TF32 and a TPU in one bfloat16 pass (on an H200 that changed `small`'s greedy tokens against transformers').
The CPU multiplies float32 at float32 either way. Products of bfloat16 operands
keep the backend's default, which is what serving them in bfloat16 is for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxhybrid.ops import placement


def of(*operands: jax.Array) -> jax.lax.Precision | None:
    """HIGHEST when every operand is float32, else None (the backend's default). Pass a weight as stored,
    before any cast to the activations' dtype: bfloat16 weights multiply at the backend's default."""
    return jax.lax.Precision.HIGHEST if all(x.dtype == jnp.float32 for x in operands) else None


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` accumulating in, and returning, float32 whatever the operands' dtypes, at the
    precision `of` gives the operands as they are.

    In a program on CPUs bf16/f16 operands are upcast first: XLA:CPU's DotThunk rejects some BF16 x BF16 ->
    F32 products ("Unsupported element type"), and the upcast is exact (a bf16 product fits in f32), so the
    CPU computes what accelerators do natively. Elsewhere the operands go in as they are: an upcast there
    would double the bytes a product reads (`placement`: the platform is where the arrays live)."""
    hi = of(a, b)

    def upcast() -> jax.Array:
        wide = [x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x for x in (a, b)]
        return jnp.einsum(spec, *wide, precision=hi, preferred_element_type=jnp.float32)

    def native() -> jax.Array:
        return jnp.einsum(spec, a, b, precision=hi, preferred_element_type=jnp.float32)

    if not any(x.dtype in (jnp.bfloat16, jnp.float16) for x in (a, b)):
        return native()
    return placement.by_platform((a, b), cpu=upcast, default=native)

"""Multi-head latent attention (MLA) over a compressed KV cache, Kimi Linear flavour (no rotary).

The cache stores one vector per token, ``latent = [c (R dims), k_r (rope dims)]``, where ``c`` is the
already-normalised low-rank KV latent and ``k_r`` is a key part shared by all heads. ``kv_b_proj``
(checkpoint layout ``[H * (nope + v), R]``, rows grouped per head: ``nope`` key rows then ``v`` value
rows) expands ``c`` into per-head keys ``k_h = [W_uk_h c, k_r]`` and values ``v_h = W_uv_h c``.
Kimi Linear applies no rotary embedding: the "rope" dims are used as-is.

Two mathematically equal forms share one signature:

* :func:`mla_attention_expanded` materialises per-head K and V (cheap when ``T ~ S``, i.e. prefill).
* :func:`mla_attention_absorbed` folds ``W_uk`` into the query and ``W_uv`` into the output so the
  attention runs directly against the ``R``-dim latent (cheap for decode: the cache is never expanded).

Rows whose mask is entirely False return zeros (never NaN).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.ops import int8, native, precision, registry

__all__ = [
    "causal_mask",
    "mla_attention_absorbed",
    "mla_attention_causal_blocks",
    "mla_attention_expanded",
    "mla_attention_paged",
    "mla_attention_paged_reference",
]


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum`` accumulating (and returning) float32 whatever the operand dtypes: `precision.einsum_f32`."""
    return precision.einsum_f32(spec, a, b)


def causal_mask(start: jax.Array, num_new: int, kv_len: int, valid: jax.Array | None = None) -> jax.Array:
    """Boolean ``[B, num_new, kv_len]`` visibility mask for ``num_new`` queries appended to a cache.

    Query ``t`` of row ``b`` sits at absolute position ``start[b] + t`` and may see key ``j`` iff
    ``j <= start[b] + t``. With ``valid`` (``[B]``, real new tokens per row; the rest is padding) keys
    at or beyond ``start[b] + valid[b]`` are hidden too, so padded slots are never attended to.
    """
    start = jnp.asarray(start, jnp.int32)
    q_pos = start[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]  # [B, T]
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = k_pos <= q_pos[:, :, None]
    if valid is not None:
        end = start + jnp.asarray(valid, jnp.int32)
        mask = mask & (k_pos < end[:, None, None])
    return mask


def _split_kv_b(
    q: jax.Array, latent: jax.Array, kv_b_weight: jax.Array, nope_dim: int, v_dim: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Check shapes and split into ``(q_nope, q_rope, c, k_r, W_uk [H, nope, R], W_uv [H, v, R])``."""
    num_heads = q.shape[2]
    rank = kv_b_weight.shape[1]
    rope_dim = q.shape[-1] - nope_dim
    if rope_dim < 0 or latent.shape[-1] != rank + rope_dim:
        raise ValueError(
            f"latent last dim {latent.shape[-1]} != kv_lora_rank {rank} + rope dim {rope_dim} "
            f"(q last dim {q.shape[-1]} - nope_dim {nope_dim})"
        )
    if kv_b_weight.shape[0] != num_heads * (nope_dim + v_dim):
        raise ValueError(
            f"kv_b_weight has {kv_b_weight.shape[0]} rows, expected H*(nope+v) = "
            f"{num_heads}*({nope_dim}+{v_dim})"
        )
    w = kv_b_weight.reshape(num_heads, nope_dim + v_dim, rank)
    return (
        q[..., :nope_dim],
        q[..., nope_dim:],
        latent[..., :rank],
        latent[..., rank:],
        w[:, :nope_dim, :],
        w[:, nope_dim:, :],
    )


def _masked_exp(scores: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The unnormalised float32 softmax of ``[B, H, T, S]`` scores under a ``[B, T, S]`` mask, and the
    reciprocal of each row's sum as ``[B, T, H, 1]`` (the layout of the attention output).

    Dividing the ``[B, T, H, v]`` output instead of the ``[B, H, T, S]`` probabilities is the same
    arithmetic on S / v times fewer numbers. Masked entries are exactly 0; a row with no visible key has
    sum 0, a guarded reciprocal, and comes out as zeros (never NaN): the max is taken over visible
    entries only.
    """
    mask = mask[:, None, :, :]
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(exp, axis=-1, keepdims=True)
    return exp, jnp.swapaxes(1.0 / jnp.where(denom > 0, denom, 1.0), 1, 2)


def mla_attention_expanded(
    q: jax.Array,
    latent: jax.Array,
    kv_b_weight: jax.Array,
    mask: jax.Array,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
) -> jax.Array:
    """MLA by materialising per-head keys and values from the latent cache.

    Args:
      q: ``[B, T, H, nope + rope]`` queries.
      latent: ``[B, S, R + rope]`` cache entries ``[c, k_r]``.
      kv_b_weight: ``[H * (nope + v), R]`` kv_b_proj weight (checkpoint layout).
      mask: ``[B, T, S]`` bool, True where the query may attend to the key.
      scale: softmax scale, normally ``(nope + rope) ** -0.5``.

    Returns:
      ``[B, T, H, v]`` in ``q.dtype``; fully masked rows are zeros.
    """
    return mla_attention_causal_blocks(
        q, latent, kv_b_weight, mask, nope_dim=nope_dim, v_dim=v_dim, scale=scale, block=q.shape[1]
    )


def mla_attention_causal_blocks(
    q: jax.Array,
    latent: jax.Array,
    kv_b_weight: jax.Array,
    mask: jax.Array,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
    block: int = 512,
) -> jax.Array:
    """:func:`mla_attention_expanded` over blocks of `block` queries, block i against keys ``[0, (i + 1) *
    block)`` only: a causal pass from position 0 (the full pass, S == T) skips the keys its mask hides
    anyway, about half the scores at T >> block, and each block's scores stay a fraction of the [T, S] ones.

    Requires that no query of block i sees a key at or past ``(i + 1) * block`` (true for a causal mask
    from position 0; any other mask needs ``block >= T``, the plain expanded form). Same arguments and
    result as :func:`mla_attention_expanded` otherwise.
    """
    q_nope, q_rope, c, k_r, w_uk, w_uv = _split_kv_b(q, latent, kv_b_weight, nope_dim, v_dim)
    # Head-major keys, values and scores ([B, H, S, .]): every matmul then reads and writes its operands in
    # their natural layout (token-major ones made XLA:CPU transpose the [T, S] probabilities per head).
    k_nope = _einsum_f32("bsr,hnr->bhsn", c, w_uk).astype(q.dtype)
    values = _einsum_f32("bsr,hvr->bhsv", c, w_uv).astype(q.dtype)
    k_r = k_r.astype(q.dtype)
    q_h = jnp.swapaxes(q, 1, 2)  # [B, H, T, nope + rope]
    t, s = q.shape[1], latent.shape[1]
    outs = []
    for lo in range(0, max(t, 1), max(block, 1)):
        hi = min(lo + block, t)
        keys = s if hi == t else min(hi, s)  # the last block (or the only one) sees every key
        qb = q_h[:, :, lo:hi]
        scores = _einsum_f32("bhtn,bhsn->bhts", qb[..., :nope_dim], k_nope[:, :, :keys])
        scores = (scores + _einsum_f32("bhte,bse->bhts", qb[..., nope_dim:], k_r[:, :keys])) * scale
        exp, inv = _masked_exp(scores, mask[:, lo:hi, :keys])
        out = _einsum_f32("bhts,bhsv->bhtv", exp.astype(q.dtype), values[:, :, :keys])
        outs.append(jnp.swapaxes(out, 1, 2) * inv)
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


def mla_attention_absorbed(
    q: jax.Array,
    latent: jax.Array,
    kv_b_weight: jax.Array,
    mask: jax.Array,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
) -> jax.Array:
    """MLA with ``W_uk`` / ``W_uv`` absorbed, attending directly over the ``R``-dim latent (decode path).

    ``q_nope_h . (W_uk_h c) = (W_uk_h^T q_nope_h) . c``, so the query is projected into latent space
    once per step instead of expanding every cached token; likewise ``sum_s p_s W_uv_h c_s =
    W_uv_h (sum_s p_s c_s)``. Same arguments and result as :func:`mla_attention_expanded`.
    """
    q_nope, q_rope, c, k_r, w_uk, w_uv = _split_kv_b(q, latent, kv_b_weight, nope_dim, v_dim)
    q_lat = _einsum_f32("bthn,hnr->bthr", q_nope, w_uk).astype(q.dtype)
    scores = _einsum_f32("bthr,bsr->bhts", q_lat, c.astype(q.dtype))
    scores = scores + _einsum_f32("bthe,bse->bhts", q_rope, k_r.astype(q.dtype))
    exp, inv = _masked_exp(scores * scale, mask)
    out_lat = _einsum_f32("bhts,bsr->bthr", exp.astype(q.dtype), c.astype(q.dtype)) * inv
    out = _einsum_f32("bthr,hvr->bthv", out_lat.astype(q.dtype), w_uv)
    return out.astype(q.dtype)


def mla_attention_paged_reference(
    q: jax.Array,
    pool: jax.Array,
    block_table: jax.Array,
    end: jax.Array,
    kv_b_weight: jax.Array | int8.Int8,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
) -> jax.Array:
    """A few new tokens per row (q ``[B, T, H, nope + rope]``) attending over positions of a paged latent pool
    ``[num_blocks, block_size, R + rope]`` through ``block_table`` ``[B, W]`` (the new tokens' latents
    already written there): token t of row b sees the positions ``< end[b, t]`` (``end`` [B, T]; or [B]:
    every token of row b sees ``< end[b]``). The rows' view gathered, then :func:`mla_attention_absorbed`.
    ``kv_b_weight``: the weight, or its int8 codes (dequantized here). Returns ``[B, T, H, v]`` in q.dtype;
    a token with ``end = 0`` gives zeros."""
    if isinstance(kv_b_weight, int8.Int8):
        kv_b_weight = int8.dequantize(kv_b_weight, q.dtype)
    b, w = block_table.shape
    view = pool[block_table].reshape(b, w * pool.shape[1], pool.shape[2])
    mask = jnp.arange(view.shape[1])[None, None, :] < _token_ends(end, q.shape[1])[:, :, None]
    return mla_attention_absorbed(
        q, view.astype(q.dtype), kv_b_weight, mask, nope_dim=nope_dim, v_dim=v_dim, scale=scale
    )


def mla_attention_paged_native(
    q: jax.Array,
    pool: jax.Array,
    block_table: jax.Array,
    end: jax.Array,
    kv_b_weight: jax.Array | int8.Int8,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
) -> jax.Array:
    """:func:`mla_attention_paged_reference` through the native CPU kernel: the latents read in place
    through the block table, once for all of a row's tokens and heads; int8 weight codes read as they are."""
    b, t, h, _ = q.shape
    call = jax.ffi.ffi_call(
        native.mla_decode_kernel(),
        jax.ShapeDtypeStruct((b, t, h, v_dim), jnp.float32),
        vmap_method="sequential",
    )
    if isinstance(kv_b_weight, int8.Int8):
        w, w_scale = kv_b_weight.q, kv_b_weight.scale
    else:
        w, w_scale = kv_b_weight, jnp.ones(kv_b_weight.shape[:1], jnp.float32)
    o = call(
        q,
        pool,
        jnp.asarray(block_table, jnp.int32),
        _token_ends(end, t),
        w,
        w_scale,
        scale=np.float32(scale),
        nope=np.int64(nope_dim),
    )
    return o.astype(q.dtype)


def mla_attention_paged(
    q: jax.Array,
    pool: jax.Array,
    block_table: jax.Array,
    end: jax.Array,
    kv_b_weight: jax.Array | int8.Int8,
    *,
    nope_dim: int,
    v_dim: int,
    scale: float,
) -> jax.Array:
    """:func:`mla_attention_paged_reference` as `jaxhybrid.ops.registry` chooses: in a program on CPUs the
    native kernel where it takes the operands (:func:`paged_kernel_takes`); elsewhere the reference. Same
    signature and results."""
    shape = {"nope_dim": nope_dim, "v_dim": v_dim, "scale": scale}
    return MLA_ATTENTION_PAGED(q, pool, block_table, end, kv_b_weight, **shape)


PAGED_KERNEL_MAX_TOKENS = 8  # tokens per row up to which the CPU kernel runs (past it XLA's products win)


def _token_ends(end: Any, num_tokens: int) -> jax.Array:
    """`end` as [B, T] int32: given per token, or per row ([B]) for each of its tokens."""
    end = jnp.asarray(end, jnp.int32)
    return end if end.ndim == 2 else jnp.broadcast_to(end[:, None], (end.shape[0], num_tokens))


def paged_kernel_takes(
    q: jax.Array, pool: jax.Array, block_table: Any, end: Any, kv_b_weight: jax.Array | int8.Int8, **_: Any
) -> bool:
    """Whether the CPU kernel takes these operands: float32 q and pool, a float32 weight or int8 codes, at
    most `PAGED_KERNEL_MAX_TOKENS` tokens per row, and the kernel built."""
    if q.shape[1] > PAGED_KERNEL_MAX_TOKENS:
        return False
    weight_ok = isinstance(kv_b_weight, int8.Int8) or kv_b_weight.dtype == jnp.float32
    if q.dtype != jnp.float32 or pool.dtype != jnp.float32 or not weight_ok:
        return False
    return native.mla_decode_kernel() is not None


def paged_kernel_applies(q: jax.Array, pool: jax.Array, kv_b_weight: jax.Array | int8.Int8) -> bool:
    """Whether :func:`mla_attention_paged` runs the CPU kernel for these operands in a program on CPUs
    (`placement` says where one runs) under the current kernels mode."""
    allowed = registry.allows(registry.Kind.NATIVE)
    return allowed and paged_kernel_takes(q, pool, None, None, kv_b_weight)


MLA_ATTENTION_PAGED = registry.Op(
    "mla_attention_paged",
    mla_attention_paged_reference,
    registry.cpu_kernel(mla_attention_paged_native, paged_kernel_takes),
)

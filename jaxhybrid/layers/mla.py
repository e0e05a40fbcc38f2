"""Multi-head latent attention, Kimi Linear flavour (no rotary embedding; checkpoint names `self_attn.*`).

Kimi K3 adds an output gate (`mla_use_output_gate`): the attention result [.., H*v] is multiplied per
channel by `sigmoid(g_proj(x))` before `o_proj`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.cache import SCRATCH_BLOCK, MLACache, MLAView, MLAWrite, PagedMLACache
from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Linear, RMSNorm, project
from jaxhybrid.ops.mla import (
    causal_mask,
    mla_attention_absorbed,
    mla_attention_causal_blocks,
    mla_attention_expanded,
    mla_attention_paged,
    paged_kernel_applies,
)
from jaxhybrid.ops.placement import by_platform

# Queries per block of the full pass's causal attention: block i attends keys [0, CAUSAL_BLOCK * (i + 1))
# only, so a long pass skips most of the masked half of the scores instead of computing and discarding it.
CAUSAL_BLOCK = 256
# Up to this many new tokens after a cache (a decode step, a verified window of drafted tokens) attend in the
# latent space (absorbed), as a decode step does, so a verified position computes what decode would; longer
# chunks expand the cached latents. The absorbed form costs less for a few new tokens and more for many; on
# XLA:CPU the two cost about the same at 16.
ABSORBED_MAX_TOKENS = 16
LORA_NORM_EPS = 1e-6  # the default of ModelConfig.mla_lora_norm_eps (q_a/kv_a_layernorm), not rms_norm_eps


def write_latent(kv: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, L] into kv [B, S, L] at row-wise offsets start [B] (caller keeps start+T <= S)."""
    return jax.vmap(lambda buf, upd, s: jax.lax.dynamic_update_slice(buf, upd, (s, 0)))(kv, new, start)


def write_paged(cache: PagedMLACache, new: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """Scatter new [B, T, L] into the pool at each row's next positions; padding goes to the scratch block."""
    B, T, _ = new.shape
    block_size, max_blocks = cache.pool.shape[1], cache.block_table.shape[1]
    pos = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    idx = jnp.minimum(pos // block_size, max_blocks - 1)
    block = jnp.take_along_axis(cache.block_table, idx, axis=1)
    if lengths is not None:
        block = jnp.where(jnp.arange(T)[None, :] < lengths[:, None], block, SCRATCH_BLOCK)
    return cache.pool.at[block, pos % block_size].set(new.astype(cache.pool.dtype))


def patch_rows(kv: jax.Array, new: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(kv [B, S, L] with new [B, T, L] at positions start[b] + t, positions past S dropped; and new as read
    back from it, or itself where dropped). Writing the read-back value into the pool makes the pool's
    write depend on its read, so XLA orders them and updates the pool in place instead of copying it."""
    B, T, _ = new.shape
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    new = new.astype(kv.dtype)
    kv = kv.at[rows, pos].set(new, mode="drop")
    back = kv.at[rows, pos].get(mode="fill", fill_value=0)
    return kv, jnp.where((pos < kv.shape[1])[..., None], back, new)


def read_paged(pool: jax.Array, block_table: jax.Array) -> jax.Array:
    """Each row's positions as one contiguous [B, max_blocks * block_size, L] view."""
    B, max_blocks = block_table.shape
    return pool[block_table].reshape(B, max_blocks * pool.shape[1], pool.shape[2])


class MultiHeadLatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim, self.rank = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        self.scale = cfg.qk_head_dim**-0.5
        self.q_lora = cfg.q_lora_rank is not None
        # Logical axes: "heads" marks head-major dimensions (H * per-head width); "kv_latent" the
        # compressed latent (c and the shared k_r), which has no head axis; "q_lora" the query low rank.
        if self.q_lora:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, rngs=rngs, dtype=dtype, axes=("q_lora", "embed"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_lora_norm_eps, dtype=dtype, axis="q_lora")
            self.q_b_proj = Linear(
                cfg.q_lora_rank, H * cfg.qk_head_dim, rngs=rngs, dtype=dtype, axes=("heads", "q_lora")
            )
        else:
            self.q_proj = Linear(D, H * cfg.qk_head_dim, rngs=rngs, dtype=dtype, axes=("heads", "embed"))
        self.kv_a_proj_with_mqa = Linear(
            D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, rngs=rngs, dtype=dtype, axes=("kv_latent", "embed")
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_lora_norm_eps, dtype=dtype, axis="kv_latent")
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank,
            H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            rngs=rngs,
            dtype=dtype,
            axes=("heads", "kv_latent"),
        )
        self.o_proj = Linear(H * cfg.v_head_dim, D, rngs=rngs, dtype=dtype, axes=("embed", "heads"))
        self.output_gate = cfg.mla_use_output_gate
        if self.output_gate:
            self.g_proj = Linear(D, H * cfg.v_head_dim, rngs=rngs, dtype=dtype, axes=("heads", "embed"))

    def query_and_latent(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The queries [.., H, nope + rope] and each token's cache entry [.., kv_lora_rank + rope] (normalised
        c and the shared unrotated k_r); both projections of x at once (one kernel call in a CPU decode)."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        q, ckr = project(x, first, self.kv_a_proj_with_mqa)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        c, k_r = ckr[..., : self.rank], ckr[..., self.rank :]
        latent = jnp.concatenate([self.kv_a_layernorm(c), k_r], axis=-1)
        return q.reshape(*x.shape[:-1], self.num_heads, self.nope + self.rope), latent

    def attend(
        self, q: jax.Array, kv: jax.Array, mask: jax.Array, absorbed: bool, x: jax.Array, causal: bool = False
    ) -> jax.Array:
        """Attention of q over the latents kv, gated by `sigmoid(g_proj(x))` (K3) and projected by o_proj.
        `causal`: kv is q's own tokens from position 0 (the full pass), so blocks of queries skip the keys
        after them."""
        fn = mla_attention_absorbed if absorbed else mla_attention_expanded
        if causal:
            fn = functools.partial(mla_attention_causal_blocks, block=CAUSAL_BLOCK)
        o = fn(
            q,
            kv,
            self.kv_b_proj.dense_weight(q.dtype),
            mask,
            nope_dim=self.nope,
            v_dim=self.v_dim,
            scale=self.scale,
        )
        return self.output(o, x)

    def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """The heads' attention o [B, T, H, v] gated by `sigmoid(g_proj(x))` (K3) and projected by o_proj."""
        o = o.reshape(*o.shape[:2], self.num_heads * self.v_dim)
        if self.output_gate:
            gate = jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))
            o = (o.astype(jnp.float32) * gate).astype(o.dtype)
        return self.o_proj(o)

    def decode_paged(
        self,
        x: jax.Array,
        q: jax.Array,
        new: jax.Array,
        cache: PagedMLACache,
        lengths: jax.Array | None,
        added: jax.Array,
    ) -> tuple[jax.Array, PagedMLACache] | None:
        """A few new tokens per row (a decode or verify step, on CPUs) where `mla_attention_paged` runs its
        kernel: the new latents written into the pool first, then attention over the pool where it lies (no
        gathered copy of the rows' view), token t seeing the positions up to its own (and none past the row's
        valid tokens). None where the kernel does not apply (the caller takes `attend_paged_view`)."""
        w = self.kv_b_proj.codes() if self.kv_b_proj.is_int8 else self.kv_b_proj.dense_weight(q.dtype)
        if not paged_kernel_applies(q, cache.pool, w):
            return None
        pool = write_paged(cache, new, lengths)
        end = cache.length + added
        ends = jnp.minimum(
            cache.length[:, None] + jnp.arange(1, x.shape[1] + 1, dtype=jnp.int32), end[:, None]
        )
        o = mla_attention_paged(
            q, pool, cache.block_table, ends, w, nope_dim=self.nope, v_dim=self.v_dim, scale=self.scale
        )
        return self.output(o, x), PagedMLACache(pool=pool, block_table=cache.block_table, length=end)

    def attend_paged_view(
        self,
        x: jax.Array,
        q: jax.Array,
        new: jax.Array,
        cache: PagedMLACache,
        lengths: jax.Array | None,
        added: jax.Array,
    ) -> tuple[jax.Array, PagedMLACache]:
        """New tokens attending over the rows' view of the pool, gathered through the block table; then the
        new latents written into the pool. The view is read before the write and the new latents put into
        the read copy: the write then updates the pool in place (read after the write, XLA reads the old pool
        and copies it whole)."""
        view = read_paged(cache.pool, cache.block_table)
        y, written = self.attend_rows(x, q, new, view, cache.length, lengths)
        pool = write_paged(cache, written, lengths)
        return y, PagedMLACache(pool=pool, block_table=cache.block_table, length=cache.length + added)

    def attend_rows(
        self,
        x: jax.Array,
        q: jax.Array,
        new: jax.Array,
        view: jax.Array,
        start: jax.Array,
        lengths: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        """Attention over the rows' pool view [B, S, L] with the new latents patched in at `start`: (y, the
        new latents as read back from the view, what goes into the pool)."""
        kv, written = patch_rows(view, new, start)
        mask = causal_mask(start, x.shape[1], kv.shape[1], lengths)
        return self.attend(q, kv.astype(x.dtype), mask, absorbed=self.absorbs(x.shape[1]), x=x), written

    @staticmethod
    def absorbs(num_new: int) -> bool:
        """Whether `num_new` tokens after a cache attend in the latent space (`ABSORBED_MAX_TOKENS`)."""
        return num_new <= ABSORBED_MAX_TOKENS

    def __call__(
        self,
        x: jax.Array,
        cache: MLACache | PagedMLACache | MLAView | None = None,
        lengths: jax.Array | None = None,
    ) -> tuple[jax.Array, MLACache | PagedMLACache | MLAWrite]:
        """x [B, T, D] -> (y, cache). No cache: causal attention within x. T == 1 uses the absorbed form.
        An `MLAView` returns the latents to write (`MLAWrite`), the pool stays with the caller."""
        B, T, _ = x.shape
        q, new = self.query_and_latent(x)
        added = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        if isinstance(cache, PagedMLACache):
            through_view = lambda: self.attend_paged_view(x, q, new, cache, lengths, added)  # noqa: E731
            return by_platform(
                (q, cache.pool),
                cpu=lambda: self.decode_paged(x, q, new, cache, lengths, added) or through_view(),
                default=through_view,
            )
        if isinstance(cache, MLAView):
            y, written = self.attend_rows(x, q, new, cache.view, cache.length, lengths)
            return y, MLAWrite(new=written, length=cache.length + added)
        if cache is None:
            start = jnp.zeros((B,), jnp.int32)
            kv = new
        else:
            start = cache.length
            kv = write_latent(cache.kv, new.astype(cache.kv.dtype), start)
        mask = causal_mask(start, T, kv.shape[1], lengths)
        absorbed = cache is not None and self.absorbs(T)
        y = self.attend(q, kv.astype(x.dtype), mask, absorbed=absorbed, x=x, causal=cache is None)
        return y, MLACache(kv=kv, length=start + added)

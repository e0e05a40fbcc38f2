"""Kimi Delta Attention layer (checkpoint names `self_attn.*` of KDA layers).

Kimi K3 variants, each switched on by its config field: the bounded forget gate (`gate_lower_bound`), the
full-rank output gate `g_proj` in place of `g_a_proj`/`g_b_proj` (`use_full_rank_gate`), and an `A_log`
stored with more entries than heads, of which the first H are used (`kda_a_log_size`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.cache import KDACache, KDAPoolInPlace, KDAPoolRows
from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import DepthwiseConv, GatedRMSNorm, Linear, param, project
from jaxhybrid.ops.conv import causal_conv1d, causal_conv1d_into_pool, causal_conv1d_windows
from jaxhybrid.ops.kda import kda_chunked, kda_decode, kda_decode_into_pool, kda_decode_states
from jaxhybrid.ops.norms import l2_normalize


def valid_mask(batch: int, num_tokens: int, lengths: jax.Array | None) -> jax.Array | None:
    """[B, T] bool: which of the new tokens are real (None when all are)."""
    if lengths is None:
        return None
    return jnp.arange(num_tokens)[None, :] < lengths[:, None]


class KimiDeltaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        D, H, d, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        self.num_heads, self.head_dim = H, d
        self.gate_lower_bound = cfg.gate_lower_bound
        # Logical axes: "kda_heads" marks every dimension laid out head-major over the H heads (H*d
        # projections and conv channels, per-head scalars); "kda_head_dim" the d-wide low-rank gate dims.
        heads_in = ("kda_heads", "embed")
        self.q_proj = Linear(D, H * d, rngs=rngs, dtype=dtype, axes=heads_in)
        self.k_proj = Linear(D, H * d, rngs=rngs, dtype=dtype, axes=heads_in)
        self.v_proj = Linear(D, H * d, rngs=rngs, dtype=dtype, axes=heads_in)
        self.q_conv1d = DepthwiseConv(H * d, K, rngs=rngs, dtype=dtype, axis="kda_heads")
        self.k_conv1d = DepthwiseConv(H * d, K, rngs=rngs, dtype=dtype, axis="kda_heads")
        self.v_conv1d = DepthwiseConv(H * d, K, rngs=rngs, dtype=dtype, axis="kda_heads")
        self.f_a_proj = Linear(D, d, rngs=rngs, dtype=dtype, axes=("kda_head_dim", "embed"))
        self.f_b_proj = Linear(d, H * d, rngs=rngs, dtype=dtype, axes=("kda_heads", "kda_head_dim"))
        self.dt_bias = param(jnp.ones((H * d,), jnp.float32), ("kda_heads",))
        a_init = jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, 1.0, 16.0))
        # A padded A_log (K3: 128 entries for 96 heads, zeros after H) is replicated: its entries do not
        # fall on head boundaries of a tensor split.
        padded = cfg.a_log_size
        a_init = jnp.pad(a_init, (0, padded - H))
        self.A_log = param(
            a_init.reshape(1, 1, padded, 1), (None, None, "kda_heads" if padded == H else None, None)
        )
        self.b_proj = Linear(D, H, rngs=rngs, dtype=dtype, axes=heads_in)
        self.full_rank_gate = cfg.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = Linear(D, H * d, rngs=rngs, dtype=dtype, axes=heads_in)
        else:
            self.g_a_proj = Linear(D, d, rngs=rngs, dtype=dtype, axes=("kda_head_dim", "embed"))
            self.g_b_proj = Linear(d, H * d, rngs=rngs, dtype=dtype, axes=("kda_heads", "kda_head_dim"))
        self.o_norm = GatedRMSNorm(d, cfg.rms_norm_eps, dtype=dtype, axis="kda_head_dim")
        self.o_proj = Linear(H * d, D, rngs=rngs, dtype=dtype, axes=("embed", "kda_heads"))

    def forget_gate(self, x: jax.Array) -> jax.Array:
        """Per-channel log-decay g [B, T, H, d] (<= 0), in fp32."""
        return self.decay(self.f_a_proj(x))

    def decay(self, f_a: jax.Array) -> jax.Array:
        """The forget gate from `f_a_proj(x)` [B, T, d]."""
        B, T, _ = f_a.shape
        raw = self.f_b_proj(f_a).astype(jnp.float32).reshape(B, T, self.num_heads, self.head_dim)
        raw = raw + self.dt_bias[...].astype(jnp.float32).reshape(self.num_heads, self.head_dim)
        a = jnp.exp(
            self.A_log[...].astype(jnp.float32).reshape(-1)[: self.num_heads].reshape(self.num_heads, 1)
        )
        if self.gate_lower_bound is None:
            return -a * jax.nn.softplus(raw)
        return self.gate_lower_bound * jax.nn.sigmoid(a * raw)

    def output_gate(self, x: jax.Array) -> jax.Array:
        """Pre-sigmoid gate [B, T, H*d] of the gated o_norm: full rank (K3) or low rank."""
        return self.gate_from(self.gate_input()(x))

    def gate_input(self) -> Linear:
        """The output gate's projection of x: `g_proj` (full rank) or `g_a_proj` (low rank)."""
        return self.g_proj if self.full_rank_gate else self.g_a_proj

    def gate_from(self, projected: jax.Array) -> jax.Array:
        """The output gate from `gate_input()(x)`."""
        return projected if self.full_rank_gate else self.g_b_proj(projected)

    def __call__(
        self,
        x: jax.Array,
        cache: KDACache | KDAPoolRows | KDAPoolInPlace | None = None,
        lengths: jax.Array | None = None,
        keep_states: bool = False,
    ) -> tuple[jax.Array, KDACache]:
        """x [B, T, D] -> (y [B, T, D], cache after the valid tokens). T == 1 uses the recurrent form.
        `keep_states`: the recurrent form, and the cache after every token instead (conv [B, T, C, K-1],
        state [B, T, H, d, d]; past a row's length, the cache after its last valid token). A
        `KDAPoolInPlace` cache (T == 1 only) returns its pools with the rows' new caches in their slots."""
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        pools = cache if isinstance(cache, KDAPoolInPlace) else None
        if pools is not None and (T != 1 or keep_states):
            raise ValueError("pools updated in place take one token per row")
        if isinstance(cache, KDAPoolRows) and T != 1 and not keep_states:
            cache = cache.gathered()  # a prefill reads a copy; decode and verify steps read the rows in place
        # every projection of x at once (one kernel call in a CPU decode step)
        *qkv, f_a, b, gate = project(
            x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.gate_input()
        )
        qkv = jnp.concatenate(qkv, axis=-1)
        conv_w = jnp.concatenate(
            [c.weight[...][:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], axis=0
        ).astype(x.dtype)
        if pools is not None:
            qkv, conv_state = causal_conv1d_into_pool(qkv, conv_w, pools.conv, pools.rows, lengths)
        else:
            conv = causal_conv1d_windows if keep_states else causal_conv1d
            qkv, conv_state = conv(qkv, conv_w, None if cache is None else cache.conv, lengths)
        qkv = jax.nn.silu(qkv)
        q, k, v = (t.reshape(B, T, H, d) for t in jnp.split(qkv, 3, axis=-1))
        q = l2_normalize(q.astype(jnp.float32)) * (d**-0.5)
        k = l2_normalize(k.astype(jnp.float32))
        g = self.decay(f_a)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        mask = valid_mask(B, T, lengths)
        if mask is not None:  # padded tokens must leave the state untouched: no decay, no write
            g = g * mask[:, :, None, None]
            beta = beta * mask[:, :, None]
        if pools is not None:
            o, state = kda_decode_into_pool(q, k, v.astype(jnp.float32), g, beta, pools.state, pools.rows)
        elif isinstance(cache, KDAPoolRows):
            step = kda_decode_states if keep_states else kda_decode
            o, state = step(q, k, v.astype(jnp.float32), g, beta, cache.state, rows=cache.rows)
        else:
            kda = kda_decode_states if keep_states else kda_decode if T == 1 else kda_chunked
            o, state = kda(q, k, v.astype(jnp.float32), g, beta, None if cache is None else cache.state)
        gate = self.gate_from(gate).reshape(B, T, H, d)
        o = self.o_norm(o.astype(x.dtype), gate).reshape(B, T, H * d)
        return self.o_proj(o), KDACache(conv=conv_state, state=state)

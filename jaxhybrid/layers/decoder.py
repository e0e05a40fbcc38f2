"""Decoder layer: `x += mixer(input_layernorm(x)); x += ffn(post_attention_layernorm(x))`.

With Kimi K3's attention residuals (`attn_res_block_size`) the layer instead reads its inputs as learned
mixes of the residual blocks and the current partial sum (`ops.attn_res`), see `attn_res_call`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.cache import LayerCache
from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Linear, RMSNorm, SwiGLU, gated_activation
from jaxhybrid.layers.kda import KimiDeltaAttention, valid_mask
from jaxhybrid.layers.mla import MultiHeadLatentAttention
from jaxhybrid.layers.moe import MoE
from jaxhybrid.ops.attn_res import attn_res_mix


def res_mix(partial: jax.Array, blocks: Sequence[jax.Array], norm: RMSNorm, proj: Linear) -> jax.Array:
    """The AttnRes read of (blocks, partial) with one `*_res_norm` / `*_res_proj` pair of weights."""
    return attn_res_mix(partial, blocks, norm.weight[...], proj.weight[...], norm.eps)


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        packed_experts: bool = False,
    ):
        """`layer` is 0-indexed; the mixer kind and FFN kind come from the config. `packed_experts`: routed
        experts kept as MXFP4."""
        self.kind = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(cfg, rngs=rngs, dtype=dtype)
        else:
            self.self_attn = MultiHeadLatentAttention(cfg, rngs=rngs, dtype=dtype)
        # Checkpoint names differ by FFN kind: `mlp.*` for dense layers, `block_sparse_moe.*` for MoE.
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, rngs=rngs, dtype=dtype, packed=packed_experts)
        else:
            self.mlp = SwiGLU(
                cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype, act=gated_activation(cfg)
            )
        # Attention residuals (K3): every layer has both reads; a layer whose index is a multiple of the
        # block size closes the running block before its mixer.
        self.attn_res = cfg.attn_res_block_size is not None
        self.starts_block = self.attn_res and layer % cfg.attn_res_block_size == 0
        if self.attn_res:
            D, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.self_attention_res_norm = RMSNorm(D, eps, dtype=dtype)
            self.self_attention_res_proj = Linear(D, 1, rngs=rngs, dtype=dtype, axes=(None, "embed"))
            self.mlp_res_norm = RMSNorm(D, eps, dtype=dtype)
            self.mlp_res_proj = Linear(D, 1, rngs=rngs, dtype=dtype, axes=(None, "embed"))

    def mixer(
        self, x: jax.Array, cache: LayerCache | None, lengths: jax.Array | None, keep_states: bool = False
    ) -> tuple[jax.Array, LayerCache]:
        """KDA or MLA; `keep_states` reaches KDA only (an MLA layer's cache is its pool either way)."""
        if self.kind == "kda" and keep_states:
            return self.self_attn(x, cache, lengths, keep_states=True)
        return self.self_attn(x, cache, lengths)

    def ffn(self, x: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        """The dense MLP or the MoE; with `lengths` [B] (the cached path) the tokens past each row's length
        (padding, idle slots) skip the routed experts."""
        if not self.is_moe:
            return self.mlp(x)
        return self.block_sparse_moe(x, valid=valid_mask(x.shape[0], x.shape[1], lengths))

    def ffn_with_load(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The FFN and, for a MoE layer, the tokens routed to each expert [E] int32 (None for dense)."""
        if self.is_moe:
            return self.block_sparse_moe(x, return_load=True)
        return self.mlp(x), None

    def __call__(
        self,
        x: jax.Array,
        cache: LayerCache | None = None,
        lengths: jax.Array | None = None,
        *,
        return_load: bool = False,
        keep_states: bool = False,
    ) -> tuple[jax.Array, LayerCache] | tuple[jax.Array, LayerCache, jax.Array | None]:
        """x [B, T, D] -> (x, cache), or (x, cache, expert load or None) with `return_load` (training).
        `keep_states`: a KDA layer returns its cache after every token (`KimiDeltaAttention`)."""
        h, cache = self.mixer(self.input_layernorm(x), cache, lengths, keep_states)
        x = x + h
        if return_load:
            f, load = self.ffn_with_load(self.post_attention_layernorm(x))
            return x + f, cache, load
        return x + self.ffn(self.post_attention_layernorm(x), lengths), cache

    def attn_res_call(
        self,
        partial: jax.Array,
        blocks: tuple[jax.Array, ...],
        cache: LayerCache | None = None,
        lengths: jax.Array | None = None,
        *,
        return_load: bool = False,
        keep_states: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, ...], LayerCache, jax.Array | None]:
        """One layer on the AttnRes stream: (partial sum, blocks) -> (partial sum, blocks, cache, load).

        1. h = mix(partial, blocks) with self_attention_res_* (h = partial while there are no blocks);
        2. a layer that starts a block appends `partial` to the blocks and restarts the sum from zero;
        3. partial += mixer(input_layernorm(h));
        4. partial += ffn(post_attention_layernorm(mix(partial, blocks) with mlp_res_*)).
        `load`: the MoE expert load with `return_load` (else None), as in `__call__`.
        """
        h = (
            res_mix(partial, blocks, self.self_attention_res_norm, self.self_attention_res_proj)
            if blocks
            else partial
        )
        restart = self.starts_block
        if restart:
            blocks = (*blocks, partial)
        a, cache = self.mixer(self.input_layernorm(h), cache, lengths, keep_states)
        partial = a if restart else partial + a
        h = self.post_attention_layernorm(res_mix(partial, blocks, self.mlp_res_norm, self.mlp_res_proj))
        f, load = self.ffn_with_load(h) if return_load else (self.ffn(h, lengths), None)
        return partial + f, blocks, cache, load

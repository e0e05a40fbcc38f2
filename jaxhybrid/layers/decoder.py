"""Decoder layer: `x += mixer(input_layernorm(x)); x += ffn(post_attention_layernorm(x))`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhybrid.cache import LayerCache
from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import RMSNorm, SwiGLU
from jaxhybrid.layers.kda import KimiDeltaAttention
from jaxhybrid.layers.mla import MultiHeadLatentAttention
from jaxhybrid.layers.moe import MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        """`layer` is 0-indexed; the mixer kind and FFN kind come from the config."""
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
            self.block_sparse_moe = MoE(cfg, rngs=rngs, dtype=dtype)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def __call__(
        self, x: jax.Array, cache: LayerCache | None = None, lengths: jax.Array | None = None
    ) -> tuple[jax.Array, LayerCache]:
        h, cache = self.self_attn(self.input_layernorm(x), cache, lengths)
        x = x + h
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return x + ffn(self.post_attention_layernorm(x)), cache

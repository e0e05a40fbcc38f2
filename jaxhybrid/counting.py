"""Parameter counts from shapes only (`nnx.eval_shape`: nothing is allocated)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Buffer, Embedding, Linear, RMSNorm
from jaxhybrid.layers.decoder import DecoderLayer
from jaxhybrid.model import HybridLM, abstract_model, path_name


def _abstract(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> HybridLM:
    """The model with ShapeDtypeStruct leaves (unimplemented fields, i.e. MTP layers, are left out)."""
    return abstract_model(cfg, dtype, allow_unimplemented=True)


def named_shapes(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> dict[str, jax.ShapeDtypeStruct]:
    """Checkpoint-style name (`model.layers.0.self_attn.q_proj.weight`) -> shape, params and buffers."""
    state = nnx.state(_abstract(cfg, dtype), nnx.Any(nnx.Param, Buffer))
    return {path_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


class _Head(nnx.Module):
    """The parts of HybridLM outside the decoder layers, under the same names."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.attn_res_block_size is not None:  # K3 attention residuals: the model-level output read
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.output_attn_res_proj = Linear(cfg.hidden_size, 1, rngs=rngs, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype)


def _abstract_parts(cfg: ModelConfig, dtype: jnp.dtype) -> list[tuple[nnx.Module, int]]:
    """(abstract module, multiplicity): the embedding/norm/head once, and one decoder layer per distinct
    (mixer, ffn) kind times the number of layers of that kind. Layers of one kind have identical shapes, so
    this counts exactly what `abstract_model` would, in a few traces instead of one per layer."""
    kinds: dict[tuple[str, bool], list[int]] = {}
    for i, kind in enumerate(cfg.layer_types):
        kinds.setdefault((kind, cfg.is_moe_layer(i)), []).append(i)
    parts: list[tuple[nnx.Module, int]] = []
    for layers in kinds.values():
        layer = nnx.eval_shape(lambda i=layers[0]: DecoderLayer(cfg, i, rngs=nnx.Rngs(0), dtype=dtype))
        parts.append((layer, len(layers)))
    head = nnx.eval_shape(lambda: _Head(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    parts.append((head, 1))
    return parts


def count_params(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> dict[str, Any]:
    """Total and active (per token) parameter counts; buffers such as the router bias are not parameters."""
    total = routed = embedding = param_bytes = buffers = 0
    for module, times in _abstract_parts(cfg, dtype):
        for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
            leaf = var.get_value()
            size = int(np.prod(leaf.shape)) * times
            total += size
            param_bytes += size * np.dtype(leaf.dtype).itemsize
            names = [str(p) for p in path]
            if "experts" in names and "shared_experts" not in names:
                routed += size
            if "embed_tokens" in names:
                embedding += size
        buffers += times * sum(
            int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(module, Buffer))
        )
    k, e = cfg.num_experts_per_token, max(cfg.num_experts, 1)
    inactive = routed - routed * k // e
    active = total - inactive
    return {
        "config": cfg.name,
        "total_params": total,
        "active_params": active,
        "active_params_without_embedding": active - embedding,
        "routed_expert_params": routed,
        "embedding_params": embedding,
        "buffer_elements": buffers,
        "param_bytes": param_bytes,
        "param_dtype": np.dtype(dtype).name,
        "approximate": bool(cfg.unimplemented),
        "unimplemented": [k for k, _ in cfg.unimplemented],
    }

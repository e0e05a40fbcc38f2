"""Parameter counts from shapes only (`nnx.eval_shape`: nothing is allocated)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import HybridLM


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> HybridLM:
    """The model with ShapeDtypeStruct leaves (K3 fields not implemented are approximated)."""
    return nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, allow_unimplemented=True))


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def named_shapes(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> dict[str, jax.ShapeDtypeStruct]:
    """Checkpoint-style name (`model.layers.0.self_attn.q_proj.weight`) -> shape, params and buffers."""
    state = nnx.state(abstract_model(cfg, dtype), nnx.Any(nnx.Param, Buffer))
    return {_path_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def count_params(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> dict[str, Any]:
    """Total and active (per token) parameter counts; buffers such as the router bias are not parameters."""
    model = abstract_model(cfg, dtype)
    total = routed = embedding = 0
    param_bytes = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf = var.get_value()
        size = int(np.prod(leaf.shape))
        total += size
        param_bytes += size * np.dtype(leaf.dtype).itemsize
        names = [str(p) for p in path]
        if "experts" in names and "shared_experts" not in names:
            routed += size
        if "embed_tokens" in names:
            embedding += size
    buffers = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, Buffer)))
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

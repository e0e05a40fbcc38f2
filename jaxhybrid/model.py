"""HybridLM: the Kimi Linear / Kimi K3 family language model (checkpoint names `model.*` and `lm_head`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.cache import LayerCache, init_cache
from jaxhybrid.config import ModelConfig
from jaxhybrid.layers.basic import Embedding, Linear, RMSNorm
from jaxhybrid.layers.decoder import DecoderLayer, res_mix
from jaxhybrid.layers.moe import Experts
from jaxhybrid.ops import precision


class NotImplementedConfigError(NotImplementedError):
    """The config sets a feature (multi-token prediction layers) that this codebase does not implement yet."""


class Backbone(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype, packed_experts: bool = False):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, packed_experts=packed_experts)
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # Attention residuals (K3): the final read of the residual blocks before `norm`.
        self.attn_res = cfg.attn_res_block_size is not None
        if self.attn_res:
            D = cfg.hidden_size
            self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
            self.output_attn_res_proj = Linear(D, 1, rngs=rngs, dtype=dtype, axes=(None, "embed"))

    def run_layers(
        self,
        h: jax.Array,
        cache: tuple[LayerCache, ...] | None,
        lengths: jax.Array | None,
        *,
        return_load: bool = False,
        keep_states: bool = False,
    ) -> tuple[jax.Array, tuple[LayerCache, ...], list[jax.Array]]:
        """Embedded tokens [B, T, D] through every decoder layer -> (hidden before `norm`, caches, loads).

        Plain residual stream, or (K3) the attention-residual stream: a partial sum plus the closed blocks,
        read by the output mix at the end. `cache` None: a full causal pass from empty caches. `loads`: the
        expert load of each MoE layer in order when `return_load`, else empty. `keep_states`: each KDA layer's
        cache after every token (`KimiDeltaAttention`)."""
        caches = (None,) * len(self.layers) if cache is None else cache
        new_cache, loads = [], []
        blocks: tuple[jax.Array, ...] = ()
        for layer, layer_cache in zip(self.layers, caches, strict=True):
            if self.attn_res:
                h, blocks, c, load = layer.attn_res_call(
                    h, blocks, layer_cache, lengths, return_load=return_load, keep_states=keep_states
                )
            elif return_load:
                h, c, load = layer(h, layer_cache, lengths, return_load=True)
            else:
                (h, c), load = layer(h, layer_cache, lengths, keep_states=keep_states), None
            new_cache.append(c)
            if load is not None:
                loads.append(load)
        if self.attn_res:
            h = res_mix(h, blocks, self.output_attn_res_norm, self.output_attn_res_proj)
        return h, tuple(new_cache), loads


class HybridLM(nnx.Module):
    """Decoder-only LM. `__call__` is the full causal pass; `forward_cached` carries the per-layer caches."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        dtype: jnp.dtype = jnp.float32,
        allow_unimplemented: bool = False,
        dequantize_experts: bool = False,
    ):
        """`allow_unimplemented` builds a config with unsupported fields (multi-token prediction) without
        them (for shape/byte accounting only). With `cfg.expert_quant == "mxfp4"` the routed experts are kept
        packed (uint8 codes + E8M0 scales, dequantized inside the expert computation) unless
        `dequantize_experts`, which holds them dense in `dtype` (3.6x the bytes at bf16; the oracle)."""
        if cfg.unimplemented and not allow_unimplemented:
            fields = ", ".join(f"{k}={v!r}" for k, v in cfg.unimplemented)
            raise NotImplementedConfigError(
                f"config '{cfg.name}' sets fields this codebase does not implement yet: {fields}"
            )
        self.config = cfg
        self.packed_experts = packed_experts(cfg, dequantize_experts)
        self.model = Backbone(cfg, rngs=rngs, dtype=dtype, packed_experts=self.packed_experts)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype, axes=("vocab", "embed"))
        )

    def logits(self, h: jax.Array) -> jax.Array:
        h = self.model.norm(h)
        if self.lm_head is None:
            w = self.model.embed_tokens.weight[...]
            return jnp.einsum("...d,vd->...v", h, w.astype(h.dtype), precision=precision.of(h, w))
        return self.lm_head(h)

    def __call__(
        self, tokens: jax.Array, *, return_expert_load: bool = False
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """tokens [B, T] -> logits [B, T, vocab] for a full causal pass from an empty cache.

        `return_expert_load`: also return the tokens routed to each expert, [MoE layers, E] int32, in layer
        order (what training's router-bias update needs); the logits are the same either way."""
        h, _, loads = self.model.run_layers(
            self.model.embed_tokens(tokens), None, None, return_load=return_expert_load
        )
        if return_expert_load:
            n = self.config.num_experts
            return self.logits(h), jnp.stack(loads) if loads else jnp.zeros((0, n), jnp.int32)
        return self.logits(h)

    def forward_cached(
        self,
        tokens: jax.Array,
        cache: tuple[LayerCache, ...],
        lengths: jax.Array | None = None,
        keep_states: bool = False,
    ) -> tuple[jax.Array, tuple[LayerCache, ...]]:
        """Run tokens [B, T] after what `cache` holds; returns (logits [B, T, vocab], new cache).

        `lengths` [B] (optional) = number of real tokens per row; the rest of each row is right padding that
        does not change any cache. MLA caches need room for T more positions after their current length.
        `keep_states`: each KDA layer's cache after every token, [B, T, ...] (verifying drafted tokens).
        """
        h, new_cache, _ = self.model.run_layers(
            self.model.embed_tokens(tokens), cache, lengths, keep_states=keep_states
        )
        return self.logits(h), new_cache

    def to_int8(self) -> None:
        """Weight-only int8 (`jaxhybrid.ops.int8`), in place, for every linear layer (lm_head included) and
        every dense expert stack; the embedding, norms, router, convolutions and MXFP4 experts stay."""
        modules = [m for _, m in nnx.iter_graph(self) if isinstance(m, Linear | Experts)]
        for m in modules:
            m.to_int8()

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> tuple[LayerCache, ...]:
        return init_cache(self.config, batch, max_len, dtype or self.model.embed_tokens.weight[...].dtype)


def set_moe_impl(model: HybridLM, impl: str) -> None:
    """Switch every MoE layer between "dropless" (ragged_dot) and "dense" (the reference)."""
    for layer in model.model.layers:
        if layer.is_moe:
            layer.block_sparse_moe.impl = impl


def set_experts_fn(model: HybridLM, fn: Callable[..., jax.Array] | None) -> None:
    """Install `fn` (signature of `ops.moe.moe_experts_dropless`) in every MoE layer; None restores `impl`."""
    for layer in model.model.layers:
        if layer.is_moe:
            layer.block_sparse_moe.experts_fn = fn


def pure_fn(model: HybridLM, method: str = "__call__") -> tuple[Callable[..., Any], Any]:
    """(jitted f(state, *args), state) for a model method: the functional form the engine compiles once."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state: Any, *args: Any) -> Any:
        return getattr(nnx.merge(graphdef, state), method)(*args)

    return f, state


def packed_experts(cfg: ModelConfig, dequantize_experts: bool = False) -> bool:
    """Whether a model of `cfg` keeps its routed experts packed (MXFP4 and not `dequantize_experts`)."""
    return getattr(cfg, "expert_quant", None) == "mxfp4" and not dequantize_experts and cfg.num_moe_layers > 0


class TraceRngs:
    """The draws of `nnx.Rngs(seed)` (draw i is `fold_in(key(seed), i)`), counted in Python: for building a
    model inside a trace (`eval_shape`, `jit`). Under a trace each draw from `nnx.Rngs` updates its counter
    through a path that walks the whole trace so far, so building costs depth squared."""

    def __init__(self, seed: int):
        self._key = jax.random.key(seed)
        self._count = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self._key, self._count)
        self._count += 1
        return key


def abstract_model(
    cfg: ModelConfig,
    dtype: Any = jnp.float32,
    seed: int = 0,
    allow_unimplemented: bool = False,
    dequantize_experts: bool = False,
) -> HybridLM:
    """HybridLM with ShapeDtypeStruct leaves (nothing allocated): shapes, shardings and loading targets."""
    return nnx.eval_shape(
        lambda: HybridLM(
            cfg,
            rngs=TraceRngs(seed),  # type: ignore[arg-type]
            dtype=dtype,
            allow_unimplemented=allow_unimplemented,
            dequantize_experts=dequantize_experts,
        )
    )


def held_bytes(model: nnx.Module) -> int:
    """Bytes of every array the model holds (parameters and buffers as stored: packed experts as uint8; on a
    mesh, of the global arrays)."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(nnx.state(model)))


def path_name(path: tuple[Any, ...]) -> str:
    """A state path as the checkpoint-style name: `model.layers.0.self_attn.q_proj.weight`."""
    return ".".join(str(p) for p in path)

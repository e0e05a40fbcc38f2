"""The jitted training and evaluation steps, pure functions of (params, buffers, optimizer state, batch).

The model is split once into its graph, its trainable `nnx.Param`s and everything else (the buffers: the
routers' `e_score_correction_bias`). The forward is the full causal pass (`HybridLM.__call__`, KDA in its
chunked form) with `return_expert_load=True`, so each step also yields the tokens routed to each expert
of each MoE layer. After the optimizer update the bias gets the aux-loss-free balancing update
(DeepSeek-V3 style): `bias += rate * sign(mean_load - load_e)`; over-loaded experts become less likely
to be picked, under-loaded ones more. The bias is not trained by gradients and never enters the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = jax.Array  # int32 [B, T + 1]: inputs are [:, :-1], targets [:, 1:]

# XLA:CPU (jaxlib 0.10.2) with its concurrency-optimized scheduler wedged this training step within a few
# dozen calls (every thread idle, the result never ready; reproduced with the step alone, no Orbax or
# tokenizer involved); with the scheduler off, hundreds of steps run. A process-wide XLA flag, read when
# the backend starts: `jaxhybrid train` sets it (see `cpu_workaround_flags`); jit's compiler_options did
# not take effect for it.
CPU_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_workaround_flags() -> None:
    """Add CPU_XLA_FLAG to XLA_FLAGS (effective only before JAX starts its backend)."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_XLA_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_XLA_FLAG}".strip()


def split_model(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """(graphdef, params, rest): trainable parameters and everything else (buffers)."""
    return nnx.split(model, nnx.Param, ...)


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy in nats/token, computed in fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def bias_delta(load: jax.Array, rate: float) -> jax.Array:
    """The aux-loss-free update of each MoE layer's router bias from its per-expert token counts
    [layers, E]: `rate * sign(mean_load - load_e)` (zero for an expert exactly at the mean)."""
    load = load.astype(jnp.float32)
    return rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)


def load_imbalance(load: jax.Array) -> jax.Array:
    """Max over mean tokens per expert, averaged over MoE layers (1 = perfectly balanced)."""
    load = load.astype(jnp.float32)
    return (load.max(axis=-1) / jnp.maximum(load.mean(axis=-1), 1e-9)).mean()


def moe_routers(model: nnx.Module) -> list[Any]:
    """The router of every MoE layer, in layer order (the rows of the expert-load array)."""
    return [layer.block_sparse_moe.gate for layer in model.model.layers if layer.is_moe]


def apply_bias_update(model: nnx.Module, load: jax.Array, rate: float) -> None:
    """Add `bias_delta(load, rate)` to each MoE layer's `e_score_correction_bias` (in place on `model`)."""
    delta = bias_delta(load, rate)
    for i, router in enumerate(moe_routers(model)):
        bias = router.e_score_correction_bias
        bias.set_value(bias.get_value() + delta[i].astype(bias.get_value().dtype))


def cast_params(params: nnx.State, dtype: jnp.dtype) -> nnx.State:
    """Matrices in the compute dtype (fp32 master weights stay with the optimizer); vectors (norm scales,
    gate constants) keep their dtype. The routers upcast to fp32 themselves."""
    if jnp.dtype(dtype) == jnp.float32:
        return params
    return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)


def make_steps(
    graphdef: Any,
    tx: optax.GradientTransformation,
    *,
    bias_rate: float,
    compute_dtype: jnp.dtype = jnp.float32,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(train_step, eval_step), both jitted.

    train_step(params, rest, opt_state, batch) -> (params, rest, opt_state, metrics) with metrics
    {loss, grad_norm, imbalance, load}; eval_step(params, rest, batch) -> (sum of token losses, tokens).
    """

    def forward(params: nnx.State, rest: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, cast_params(params, compute_dtype), rest)
        logits, load = model(batch[:, :-1], return_expert_load=True)
        return next_token_loss(logits, batch[:, 1:]), load

    def train_step(
        params: nnx.State, rest: nnx.State, opt_state: Any, batch: Batch
    ) -> tuple[nnx.State, nnx.State, Any, dict[str, jax.Array]]:
        (loss, load), grads = jax.value_and_grad(forward, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, params, rest)
        if bias_rate:
            apply_bias_update(model, load, bias_rate)
        _, params, rest = split_model(model)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "imbalance": load_imbalance(load) if load.shape[0] else jnp.float32(1.0),
            "load": load,
        }
        return params, rest, opt_state, metrics

    def eval_step(params: nnx.State, rest: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, cast_params(params, compute_dtype), rest)
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        n = batch[:, 1:].size
        return loss * n, jnp.float32(n)

    return jax.jit(train_step), jax.jit(eval_step)

"""Learning-rate schedule and optimizer: linear warmup then cosine decay, global-norm gradient clipping,
AdamW with weight decay on matrices only."""

from __future__ import annotations

from typing import Any

import jax
import optax


def lr_schedule(peak_lr: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.1) -> Any:
    """0 -> `peak_lr` linearly over `warmup_steps`, then cosine down to `final_fraction * peak_lr` at
    `total_steps`."""
    warmup = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=peak_lr * final_fraction,
    )


def make_optimizer(
    schedule: Any, *, weight_decay: float = 0.1, clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95
) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; norms' scales and other vectors are not decayed."""

    def decay_mask(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )

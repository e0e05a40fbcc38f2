"""The small programs that copy between the engine's pools and a slot or a prefix checkpoint: a slot's
reset, a checkpoint's copy and restore, and the KV blocks of a disk entry. Each jitted once, shared by every
runner (the runner calls them; the warm-up compiles them ahead)."""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxhybrid.cache import KDACache, narrowed


@functools.partial(jax.jit, static_argnums=(3,))
def take(
    pools: tuple[Any, ...], slot: jax.Array, block: jax.Array, dtype: str = "float32"
) -> tuple[Any, Any]:
    """Copies of one slot's KDA states (each array in `dtype` where that is narrower: `narrowed`) and one
    block's latent KV (a checkpoint's content)."""
    cast = lambda x: x.astype(narrowed(x.dtype, dtype))  # noqa: E731
    states = tuple((cast(p.conv[slot]), cast(p.state[slot])) for p in pools if isinstance(p, KDACache))
    kv = tuple(p[block] for p in pools if not isinstance(p, KDACache))
    return states, kv


@jax.jit
def gather(pools: tuple[Any, ...], blocks: jax.Array) -> tuple[Any, ...]:
    """Copies of the latent KV of `blocks` [n], per MLA layer [n, block_size, latent] (a disk entry)."""
    return tuple(p[blocks] for p in pools if not isinstance(p, KDACache))


@functools.partial(jax.jit, donate_argnums=(0,))
def put_blocks(pools: tuple[Any, ...], blocks: jax.Array, kv: tuple[Any, ...]) -> tuple[Any, ...]:
    """Write per MLA layer [n, block_size, latent] KV into `blocks` [n] (a prefix loaded from disk)."""
    kv_it = iter(kv)
    return tuple(p if isinstance(p, KDACache) else p.at[blocks].set(next(kv_it)) for p in pools)


@functools.partial(jax.jit, donate_argnums=(0,))
def put(
    pools: tuple[Any, ...], slot: jax.Array, states: tuple[Any, ...], block: jax.Array, kv: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Restore a checkpoint: its states into `slot` (in the pools' dtypes, whatever it was kept in), its
    partial block's KV into `block`."""
    states_it, kv_it, out = iter(states), iter(kv), []
    for p in pools:
        if isinstance(p, KDACache):
            conv, state = next(states_it)
            conv, state = conv.astype(p.conv.dtype), state.astype(p.state.dtype)
            out.append(KDACache(conv=p.conv.at[slot].set(conv), state=p.state.at[slot].set(state)))
        else:
            out.append(p.at[block].set(next(kv_it)))
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=(0,))
def zero_slot(pools: tuple[Any, ...], slot: jax.Array) -> tuple[Any, ...]:
    return tuple(
        KDACache(conv=p.conv.at[slot].set(0), state=p.state.at[slot].set(0)) if isinstance(p, KDACache) else p
        for p in pools
    )

"""The runner's side of the prefix store (its CheckpointSource): copies of a slot's KDA states and of latent
KV blocks for the store to keep, their host form (this process's shards where an array spans processes),
and where a disk read puts them on the mesh. The runner holds one `StoreCopies` over its pools."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.cache import SCRATCH_BLOCK
from serve.engine import copies
from serve.engine.config import EngineShape


@dataclasses.dataclass
class HostShards:
    """A device array moved to host memory, as this process's shards (with several processes no process
    holds a whole array that is sharded across them): numpy per addressable device, and the sharding."""

    shape: tuple[int, ...]
    sharding: Any
    shards: list[tuple[Any, np.ndarray]]  # (device, its shard)

    @classmethod
    def of(cls, x: jax.Array) -> HostShards:
        return cls(x.shape, x.sharding, [(s.device, np.asarray(s.data)) for s in x.addressable_shards])

    def to_device(self) -> jax.Array:
        arrays = [jax.device_put(data, device) for device, data in self.shards]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)


def _to_host(x: Any) -> Any:
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        return HostShards.of(x)
    return np.asarray(x)


def to_device(x: Any) -> Any:
    return x.to_device() if isinstance(x, HostShards) else jnp.asarray(x)


class StoreCopies:
    """The copies the prefix store keeps (its `CheckpointSource`), from a runner's pools: `pools()` gives them
    as they are now (every program call replaces them), `pool_shardings` their layout on a mesh (or None)."""

    def __init__(self, shape: EngineShape, pool_shardings: Any, pools: Callable[[], tuple[Any, ...]]):
        self.shape, self.pool_shardings, self._pools = shape, pool_shardings, pools
        self._restore_shardings: list[tuple[Any, Any]] | None = None  # `init_restore_shardings`

    def take(self, slot: int, block: int) -> tuple[Any, Any]:
        """(KDA states of `slot`, latent KV of `block`) as new device arrays."""
        return copies.take(self._pools(), jnp.int32(slot), jnp.int32(block), self.shape.checkpoint_dtype)

    def gather(self, blocks: list[int]) -> tuple[Any, ...]:
        """Per MLA layer the KV of `blocks` (rows beyond len(blocks) are padding up to a table width)."""
        ids = np.full((self.shape.table_width(len(blocks)),), SCRATCH_BLOCK, np.int32)
        ids[: len(blocks)] = blocks
        return copies.gather(self._pools(), jnp.asarray(ids))

    def gathered_bytes(self, blocks: int) -> int:
        """Device bytes one `gather` of `blocks` blocks holds (with its padding)."""
        return self.shape.table_width(blocks) * self.shape.block_bytes

    @staticmethod
    def to_host(tree: Any) -> Any:
        """A checkpoint's arrays in host memory (this process's shards of arrays sharded across processes)."""
        return jax.tree_util.tree_map(_to_host, tree)

    @staticmethod
    def pack(states: Any, kv_full: Any, num_full: int, tail: Any) -> dict[str, jax.Array]:
        """A checkpoint as the named arrays of its disk entry (on the device: with several processes each
        writes its shards): conv_i / state_i per KDA layer, kv [mla, num_full, block, latent], tail."""
        arrays = {}
        for i, (conv, state) in enumerate(states):
            arrays[f"conv_{i}"], arrays[f"state_{i}"] = conv, state
        if num_full:
            arrays["kv"] = jnp.stack([k[:num_full] for k in kv_full])
        if tail is not None:
            arrays["tail"] = jnp.stack(list(tail))
        return arrays

    def init_restore_shardings(self) -> None:
        """Learn the shardings `take` produces (one program every process runs, so call it in lockstep,
        before any read runs in the background)."""
        states, _ = self.take(0, SCRATCH_BLOCK)
        self._restore_shardings = [(c.sharding, s.sharding) for c, s in states]

    def restore_sharding(self, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        """Where a disk read puts array `name` on the mesh: a slot's states as `take` leaves them, the KV
        replicated (as the pools' block axis is)."""
        if name.startswith(("conv_", "state_")):
            kind, i = name.split("_")
            return self._restore_shardings[int(i)][kind == "state"]
        mesh = jax.tree.leaves(self.pool_shardings)[0].mesh
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

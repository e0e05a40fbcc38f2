"""Which parts of each array every host's process reads, from the arrays' shardings alone.

A replica that spans several hosts (a TPU7x slice of 32 devices is four hosts of eight) runs one process a
host, and each process puts on its own devices only their shards: `load_pretrained_on_mesh` reads a
sharded tensor's byte ranges for the addressable devices and nothing else. A device's shard is the index
its sharding gives it (`Sharding.devices_indices_map`), its host the device's `process_index`; a host whose
devices hold the same shard (a replicated array, or one split over an axis that leaves the host) reads it
once. Nothing here needs the devices to exist: a topology's described devices (`serve.engine.topology`) do.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import numpy as np

__all__ = ["HostShards", "host_shards"]

Span = tuple[tuple[int, int], ...]  # [start, stop) in each dimension


@dataclasses.dataclass(frozen=True)
class HostShards:
    """What one host's process reads: its devices (ids), each array's distinct shards on them (by the
    array's path in the tree), and their bytes."""

    process: int
    devices: tuple[int, ...]
    shards: dict[str, tuple[Span, ...]]
    nbytes: int

    def as_dict(self, with_shards: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "process": self.process,
            "devices": list(self.devices),
            "arrays": len(self.shards),
            "shards": sum(len(s) for s in self.shards.values()),
            "bytes": self.nbytes,
        }
        if with_shards:
            out["by_array"] = {k: [[list(d) for d in s] for s in v] for k, v in self.shards.items()}
        return out


def _span(index: tuple[slice, ...], shape: tuple[int, ...]) -> Span:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def host_shards(structs: Any, shardings: Any = None) -> list[HostShards]:
    """Per host (process index, ascending), the shards of the arrays in `structs` that its devices hold.
    `structs`: arrays or ShapeDtypeStructs; their own shardings, or `shardings` (a tree of the same structure,
    e.g. a compiled program's `input_shardings`, where an argument the program never reads has None: it is
    left out)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(structs)
    placements = [leaf.sharding for _, leaf in leaves] if shardings is None else tree.flatten_up_to(shardings)
    devices: dict[int, set[int]] = defaultdict(set)
    spans: dict[int, dict[str, set[Span]]] = defaultdict(dict)
    nbytes: dict[int, int] = defaultdict(int)
    for (path, leaf), sharding in zip(leaves, placements, strict=True):
        if sharding is None:
            continue
        name, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        for device, index in sharding.devices_indices_map(shape).items():
            process = device.process_index
            devices[process].add(device.id)
            held = spans[process].setdefault(name, set())
            span = _span(index, shape)
            if span not in held:
                held.add(span)
                nbytes[process] += math.prod(b - a for a, b in span) * itemsize
    out = []
    for p in sorted(devices):
        held = {k: tuple(sorted(v)) for k, v in spans[p].items()}
        out.append(HostShards(p, tuple(sorted(devices[p])), held, nbytes[p]))
    return out

"""What a router knows of one replica, from its prefix-store events (`serve.prefix.events`): the cached KV
blocks as a tree of token blocks, and the state checkpoints on it; and, for a prompt, how far that replica
could resume (`Match`).

The router never computes the store's chain hashes (they depend on the model's fingerprint): it walks the
prompt's tokens down the tree the BlockStored events describe (parent hash + tokens), so two replicas of one
model and different ones alike are read the same way. A checkpoint in device or host memory resumes a
prompt when its blocks are on the prompt's path and its tail tokens follow them; one on disk carries its own
KV, which the events do not describe block by block, so it is not counted (a miss costs recompute, never a
wrong answer: the replica's own store decides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from serve.prefix.events import (
    AllBlocksCleared,
    AllStatesCleared,
    BlockRemoved,
    BlockStored,
    Contents,
    Event,
    StateRemoved,
    StateStored,
)

MEMORY_TIERS = ("device", "host")


def block_key(tokens: Sequence[int]) -> bytes:
    """A block's tokens as a dict key (bytes keep their hash: a tuple of ints is hashed again every time)."""
    return np.asarray(tokens, np.int64).tobytes()


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """`block_key` of each full block of `tokens`."""
    n = len(tokens) // block_size
    raw, step = block_key(tokens[: n * block_size]), block_size * 8
    return [raw[i * step : (i + 1) * step] for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Match:
    """How far a replica holds a prompt: `kv_tokens` (full blocks cached along it: what a KV-only router
    sees) and `resumable` (the deepest checkpoint on that path it can resume from: the prefill it saves)."""

    kv_tokens: int = 0
    resumable: int = 0
    continues: bool = False  # that checkpoint ends a chain there (`ReplicaIndex.chains`): the prompt goes on


@dataclasses.dataclass
class ReplicaIndex(Contents):
    """What the events say a replica holds (`Contents`), with a child map for walking a prompt down its
    blocks and its memory-tier checkpoints by the block they sit after."""

    _children: dict[tuple[bytes | None, bytes], bytes] = dataclasses.field(default_factory=dict)  # block_key
    _at: dict[bytes | None, dict[bytes, StateStored]] = dataclasses.field(default_factory=dict)
    _ends: set[bytes] | None = None  # keys of the checkpoints that end a chain (None: to be worked out)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def checkpoints(self) -> int:
        return len(self.states)

    @property
    def chains(self) -> int:
        """Memory-tier checkpoints that no other one there extends: the conversations (or other prefixes)
        whose latest state the replica keeps, each one its next turn resumes from."""
        return len(self._chain_ends())

    def clear(self) -> None:
        for d in (self.blocks, self.states, self._children, self._at):
            d.clear()
        self._ends = None

    def apply(self, events: Iterable[Event]) -> None:
        self._ends = None
        for e in events:
            gone = self.states.get((e.key, e.tier)) if isinstance(e, StateRemoved) else None
            if isinstance(e, BlockRemoved):  # (before the blocks go: their entries find the children)
                for h in e.block_hashes:
                    entry = self.blocks.get(h)
                    child = None if entry is None else (entry[0], block_key(entry[1]))
                    if child is not None and self._children.get(child) == h:
                        del self._children[child]
            super().apply([e])
            if isinstance(e, BlockStored):
                for h, parent, tokens in e.blocks():
                    self._children[(parent, block_key(tokens))] = h
            elif isinstance(e, AllBlocksCleared):
                self._children.clear()
            elif isinstance(e, StateStored) and e.tier in MEMORY_TIERS:
                self._at.setdefault(e.block_hash, {})[e.key] = e
            elif gone is not None and gone.tier in MEMORY_TIERS:
                self._forget(gone)
            elif isinstance(e, AllStatesCleared):
                self._at.clear()

    def _forget(self, gone: StateStored) -> None:
        """A memory-tier copy of a checkpoint is gone: unless the other memory tier holds it, forget it."""
        if any((gone.key, t) in self.states for t in MEMORY_TIERS):
            return
        at = self._at.get(gone.block_hash, {})
        at.pop(gone.key, None)
        if not at:
            self._at.pop(gone.block_hash, None)

    def match(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> Match:
        """See `Match`. A checkpoint counts up to len(tokens) - 1 (a request computes at least its last
        prompt token). `keys`: `block_keys(tokens, self.block_size)`, when the caller has them."""
        bs = self.block_size
        if keys is None:
            keys = block_keys(tokens, bs) if bs else []
        h: bytes | None = None
        depth, (resumable, key) = 0, self._best_at(None, tokens, 0)
        while depth < len(keys):
            child = self._children.get((h, keys[depth]))
            if child is None:
                break
            h, depth = child, depth + 1
            if h in self._at:
                here = self._best_at(h, tokens, depth * bs)
                if here[0] > resumable:
                    resumable, key = here
        return Match(depth * bs, resumable, key is not None and key in self._chain_ends())

    def _best_at(self, block: bytes | None, tokens: Sequence[int], start: int) -> tuple[int, bytes | None]:
        best: tuple[int, bytes | None] = (0, None)
        for e in self._at.get(block, {}).values():
            end = start + len(e.tail)
            if end < len(tokens) and end > best[0] and list(tokens[start:end]) == list(e.tail):
                best = (end, e.key)
        return best

    def _chain_ends(self) -> set[bytes]:
        """See `chains`. A checkpoint is extended by one at a block below its own (its tail is not compared:
        it follows its block on every path that replica keeps but rarely) or by a longer tail at its block."""
        if self._ends is not None:
            return self._ends
        above: set[bytes | None] = set()  # blocks with a checkpoint somewhere below them
        for h in self._at:
            if h is None:
                continue
            above.add(None)
            parent = self.blocks.get(h, (None,))[0]
            while parent is not None and parent not in above:
                above.add(parent)
                parent = self.blocks.get(parent, (None,))[0]
        ends = set()
        for h, at in self._at.items():
            if h in above:
                continue
            tails = [tuple(e.tail) for e in at.values()]
            for e in at.values():
                t = tuple(e.tail)
                if not any(len(o) > len(t) and o[: len(t)] == t for o in tails):
                    ends.add(e.key)
        self._ends = ends
        return ends

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

from serve.prefix.events import (
    AllBlocksCleared,
    AllStatesCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StateRemoved,
    StateStored,
)

MEMORY_TIERS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class Match:
    """How far a replica holds a prompt: `kv_tokens` (full blocks cached along it: what a KV-only router
    sees) and `resumable` (the deepest checkpoint on that path it can resume from: the prefill it saves)."""

    kv_tokens: int = 0
    resumable: int = 0


class ReplicaIndex:
    """Blocks by hash (parent, tokens) with a child map for walking a prompt, and memory-tier checkpoints by
    the block they sit after."""

    def __init__(self) -> None:
        self.block_size = 0
        self._blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self._children: dict[tuple[bytes | None, tuple[int, ...]], bytes] = {}
        self._states: dict[tuple[bytes, str], StateStored] = {}
        self._at: dict[bytes | None, dict[bytes, StateStored]] = {}  # block hash -> checkpoint key -> event

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def checkpoints(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self._states.clear()
        self._at.clear()

    def apply(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.block_size = e.block_size
                for h, parent, tokens in e.blocks():
                    self._blocks[h] = (parent, tokens)
                    self._children[(parent, tokens)] = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    entry = self._blocks.pop(h, None)
                    if entry is not None and self._children.get(entry) == h:
                        del self._children[entry]
            elif isinstance(e, AllBlocksCleared):
                self._blocks.clear()
                self._children.clear()
            elif isinstance(e, StateStored):
                self._states[(e.key, e.tier)] = e
                if e.tier in MEMORY_TIERS:
                    self._at.setdefault(e.block_hash, {})[e.key] = e
            elif isinstance(e, StateRemoved):
                self._forget_state(e.key, e.tier)
            elif isinstance(e, AllStatesCleared):
                self._states.clear()
                self._at.clear()

    def _forget_state(self, key: bytes, tier: str) -> None:
        e = self._states.pop((key, tier), None)
        if e is None or tier not in MEMORY_TIERS:
            return
        if any((key, t) in self._states for t in MEMORY_TIERS):
            return  # still held in the other memory tier
        at = self._at.get(e.block_hash, {})
        at.pop(key, None)
        if not at:
            self._at.pop(e.block_hash, None)

    def match(self, tokens: Sequence[int]) -> Match:
        """See `Match`. A checkpoint counts up to len(tokens) - 1 (a request computes at least its last
        prompt token)."""
        bs = self.block_size
        h: bytes | None = None
        depth, resumable = 0, self._best_at(None, tokens, 0)
        while bs and (depth + 1) * bs <= len(tokens):
            child = self._children.get((h, tuple(tokens[depth * bs : (depth + 1) * bs])))
            if child is None:
                break
            h, depth = child, depth + 1
            resumable = max(resumable, self._best_at(h, tokens, depth * bs))
        return Match(depth * bs, resumable)

    def _best_at(self, block: bytes | None, tokens: Sequence[int], start: int) -> int:
        best = 0
        for e in self._at.get(block, {}).values():
            end = start + len(e.tail)
            if end < len(tokens) and list(tokens[start:end]) == list(e.tail):
                best = max(best, end)
        return best

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
    Contents,
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


@dataclasses.dataclass
class ReplicaIndex(Contents):
    """What the events say a replica holds (`Contents`), with a child map for walking a prompt down its
    blocks and its memory-tier checkpoints by the block they sit after."""

    _children: dict[tuple[bytes | None, tuple[int, ...]], bytes] = dataclasses.field(default_factory=dict)
    _at: dict[bytes | None, dict[bytes, StateStored]] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def checkpoints(self) -> int:
        return len(self.states)

    def clear(self) -> None:
        for d in (self.blocks, self.states, self._children, self._at):
            d.clear()

    def apply(self, events: Iterable[Event]) -> None:
        for e in events:
            gone = self.states.get((e.key, e.tier)) if isinstance(e, StateRemoved) else None
            if isinstance(e, BlockRemoved):  # (before the blocks go: their entries find the children)
                for h in e.block_hashes:
                    entry = self.blocks.get(h)
                    if entry is not None and self._children.get(entry) == h:
                        del self._children[entry]
            super().apply([e])
            if isinstance(e, BlockStored):
                for h, parent, tokens in e.blocks():
                    self._children[(parent, tokens)] = h
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

"""Finding a prompt's reusable prefix, apart from counting it: `Lookup.find` is free of side effects, so a
request that waits for blocks may be matched at every step it tries, and `Lookup.record` counts the lookup
(the counters, the value policy's clock, the recency of what it found) once, when the request is admitted
or its disk read starts. The request keeps its chain hashes (`Sequence_.chain`), so each of its blocks is
hashed once however often it is matched."""

from __future__ import annotations

import dataclasses
from typing import Any

from serve.prefix.checkpoints import CheckpointTiers
from serve.prefix.disk import DiskEntry, DiskTier
from serve.prefix.index import BlockIndex, ChainHasher, TailIndex, kv_match
from serve.prefix.stats import LookupStats
from serve.prefix.types import Checkpoint


@dataclasses.dataclass
class Hit:
    """A prompt match: reuse `hit` tokens (blocks + checkpoint), recompute the rest of `matched`. A disk hit
    has `disk` set instead of `checkpoint`; `blocks` are then the leading blocks already in the pool.
    `hashes`: the chain hashes of `blocks` (what `Lookup.record` marks used)."""

    hit: int
    matched: int
    blocks: list[int]
    checkpoint: Checkpoint | None = None
    disk: DiskEntry | None = None
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    ghost: bytes | None = None  # a dropped checkpoint deeper than `hit` that it would have resumed from

    @property
    def recomputed(self) -> int:
        return max(0, self.matched - self.hit)


def deepest_checkpoint(
    tokens: list[int],
    chain: list[bytes],
    reach: int,
    nb: int,
    hasher: ChainHasher,
    memory: Any,
    disk: Any,
    ghosts: Ghosts | None = None,
) -> tuple[int, Checkpoint | DiskEntry] | None:
    """The deepest checkpoint of `tokens` (at most len - 1) in memory, whose blocks must be among the `nb`
    in the pool, or on disk, whose entry carries its own KV (up to `reach` blocks): (position, it). With
    `ghosts`, the deepest key passed on the way that the memory tiers held and dropped is noted in it."""
    bs, limit = hasher.block_size, len(tokens) - 1
    for i in range(reach, -1, -1):
        if i * bs > limit:
            continue
        for r in range(min(bs - 1, limit - i * bs), -1, -1):
            key = hasher.checkpoint_key(chain[i], tokens[i * bs : i * bs + r])
            ck = memory.get(key) if i <= nb else None
            if ck is None and disk is not None:
                ck = disk.entries.get(key)
            if ck is not None:
                return i * bs + r, ck
            deeper = ghosts is not None and ghosts.key is None and i * bs + r <= ghosts.limit
            if deeper and memory.dropped(key):
                ghosts.key = key
    return None


@dataclasses.dataclass
class Ghosts:
    """The deepest dropped checkpoint a lookup passed, within the KV it matched (`limit` tokens)."""

    limit: int
    key: bytes | None = None


@dataclasses.dataclass
class Lookup:
    """Matches prompts against the store's block index, tails, memory checkpoints and disk entries."""

    hasher: ChainHasher
    blocks: BlockIndex
    tails: TailIndex
    checkpoints: CheckpointTiers
    disk: DiskTier | None
    stats: LookupStats
    partial_tails: bool  # the adaptive policy: any common part of a remembered tail counts as matched

    def find(self, tokens: list[int], salt: str | None, chain: list[bytes]) -> Hit:
        """Longest reusable prefix of `tokens`: all of them when a checkpoint at their end kept its next-token
        logits, else at most len - 1 (one token is left to produce logits). `chain`: the chain hashes of a
        prefix of `tokens` (or []), extended in place to all their full blocks. Changes nothing else."""
        limit, bs, disk = len(tokens) - 1, self.hasher.block_size, self.disk
        end_blocks = len(tokens) // bs
        chain = self.hasher.extend(chain, tokens, salt, end_blocks)[: end_blocks + 1]
        refs = disk.block_refs if disk is not None else ()
        nb, reach, matched = kv_match(tokens, chain, bs, self.blocks, refs, self.tails, self.partial_tails)
        matched = min(matched, limit)
        best: tuple[int, Checkpoint | DiskEntry] | None = None
        if end_blocks <= nb:  # an identical earlier prompt whose checkpoint kept its logits: nothing to do
            key = self.hasher.checkpoint_key(chain[end_blocks], tokens[end_blocks * bs :])
            ck = self.checkpoints.get(key)
            if ck is not None and ck.logits is not None:
                best, matched = (len(tokens), ck), len(tokens)
        ghosts = Ghosts(matched)
        if best is None:
            best = deepest_checkpoint(tokens, chain, reach, nb, self.hasher, self.checkpoints, disk, ghosts)
        if best is None:
            return Hit(0, matched, [], ghost=ghosts.key)
        pos, ck = best
        used = chain[1 : min(nb, pos // bs) + 1]
        blocks = [self.blocks.get(h) for h in used]
        if isinstance(ck, DiskEntry):
            return Hit(pos, max(matched, pos), blocks, disk=ck, hashes=used, ghost=ghosts.key)
        return Hit(pos, max(matched, pos), blocks, checkpoint=ck, hashes=used, ghost=ghosts.key)

    def record(self, hit: Hit) -> None:
        """Count one lookup that found `hit`: the lookup counter, the value policy's clock (recency is
        measured in lookups), and what it found marked used (blocks deepest first, its checkpoint)."""
        self.stats.lookups += 1
        self.checkpoints.looked_up()
        self.blocks.touch(hit.hashes)
        if hit.checkpoint is not None:
            self.checkpoints.used(hit.checkpoint.key)
        if hit.ghost is not None:
            self.checkpoints.missed(hit.ghost)

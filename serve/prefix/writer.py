"""Taking a state checkpoint (the prefix store's write path): at a sequence's computed position, index its
full KV blocks and its partial last block's tokens, copy its state (and that partial block's KV) from the
source into the memory tiers, and write it through to the disk tier with the KV of its whole prefix. The
store's checkpoint policy decides when (`serve.prefix.positions.CheckpointPositions`); this does it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxhybrid.cache import SCRATCH_BLOCK
from serve.prefix import junctions
from serve.prefix.checkpoints import CheckpointTiers
from serve.prefix.disk import DiskTier
from serve.prefix.entries import entry_meta
from serve.prefix.index import BlockIndex, ChainHasher, TailIndex
from serve.prefix.stats import MemoryStats
from serve.prefix.types import Checkpoint, CheckpointKind, CheckpointSource, Sequence_, Tier


@dataclasses.dataclass
class CheckpointWriter:
    """The store's indexes and tiers a checkpoint goes into (shared with the store, which reads them)."""

    hasher: ChainHasher
    blocks: BlockIndex
    tails: TailIndex
    checkpoints: CheckpointTiers
    disk: DiskTier | None
    memory_stats: MemoryStats
    fingerprint: bytes
    block_bytes: int
    state_bytes: int

    def index_blocks(self, seq: Sequence_) -> None:
        """Index `seq`'s full blocks computed since the last call, and their tokens as tails
        (`junctions.index_blocks`), without taking a checkpoint."""
        junctions.index_blocks(seq, self.hasher, self.blocks, self.tails)

    def write(
        self,
        seq: Sequence_,
        source: CheckpointSource,
        kind: CheckpointKind,
        save_state: bool = True,
        logits: Any = None,
    ) -> None:
        """Index `seq`'s blocks up to its computed position and, with `save_state`, keep its state there
        (once per position: an existing checkpoint is reused, gaining `logits` if it had none)."""
        pos, bs = seq.num_computed, self.hasher.block_size
        if pos == 0:
            return
        tokens = seq.tokens
        chain = self.hasher.extend(seq.chain, tokens, seq.cache_salt, pos // bs)[: pos // bs + 1]
        key = self.hasher.checkpoint_key(chain[-1], tokens[(pos // bs) * bs : pos])
        self.blocks.register(chain, seq.blocks[: len(chain) - 1], tokens=tokens)
        tail = tuple(tokens[(pos // bs) * bs : pos])
        if tail:
            self.tails.add(chain[-1], tail)
        if not save_state:
            return
        existing = self.checkpoints.get(key)
        if existing is not None:
            seq.checkpoint_base = key
            self.checkpoints.used(key)
            if logits is not None and existing.logits is None:
                existing.logits = logits
            return
        t0 = time.perf_counter()
        partial = pos % bs != 0
        states, kv = source.take(seq.slot, seq.blocks[pos // bs] if partial else SCRATCH_BLOCK)
        nbytes = self.state_bytes + (self.block_bytes if partial else 0)
        ck = Checkpoint(
            key,
            pos,
            states,
            kv if partial else None,
            nbytes,
            Tier.DEVICE,
            kind,
            logits=logits,
            parent=seq.checkpoint_base,
            chain=tuple(chain[1:]),
            tail=tail,
        )
        seq.checkpoint_base = key
        self.checkpoints.add(ck)
        self.checkpoints.enforce(source.to_host)
        num_full = pos // bs
        if self.disk is not None and self.disk.wants(key, nbytes + num_full * self.block_bytes):
            # write-through: the disk entry holds the KV of the whole prefix
            meta = entry_meta(key, self.fingerprint, bs, pos, kind, chain, tail)
            kv_full, held = None, nbytes  # held: device bytes the queued save keeps alive
            if num_full:
                kv_full = source.gather(seq.blocks[:num_full])
                held += source.gathered_bytes(num_full)
            arrays = source.pack(states, kv_full, num_full, kv if partial else None)
            self.disk.submit(meta, arrays, held)
        self.memory_stats.save_time_s += time.perf_counter() - t0

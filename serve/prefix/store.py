"""Prefix store: reuse a shared prompt prefix without recomputing it.

MLA layers: full KV blocks are indexed by a chained hash of their tokens and shared by reference count.
KDA layers: a state is valid only at the exact position it was taken, so the store keeps state
checkpoints at every multiple of `checkpoint_interval` tokens and (switchable) at the end of every prompt
and every finished sequence. A checkpoint that does not end on a block boundary keeps a copy of its
partial last block's KV, so short and unaligned prompts hit too. A hit is the longest prefix whose KV
blocks are present and that ends at a checkpoint.

Policies (`checkpoint_policy`): "fixed" keeps exactly the checkpoints above, evicted least recently used
first. "adaptive" treats the interval as the finest spacing (coarsened to what the budgets afford)
and adds junctions: a prompt that shares cached KV blocks beyond the state it resumes from is checkpointed
where it leaves them (its full blocks are indexed as they are computed, so the next prompt sees them), a
running request is checkpointed where a queued prompt will leave it (`expect`), and a request whose prompt
shares a prefix that a running request is still computing waits for that request's checkpoint at the end of
the shared part (the scheduler asks `shared_prefix`). What stays within the budgets is decided by the
value-aware eviction order (`serve.prefix.policies.ValueAware`: prefill saved per byte, weighted by the reuse
each kind has shown).

Tiers: checkpoints live on the device until its budget is exceeded, then in host memory, then are dropped
(`serve.prefix.checkpoints`, in an eviction policy's order). Cached KV blocks live in the engine's pool and
are evicted (LRU, only those no running request holds) when the pool runs out. With `store_dir`, every
checkpoint is also written through to disk with the KV of its whole prefix (`serve.prefix.disk`).

The engine talks to the store through these methods only: `find` / `record` (a lookup, counted once per
admission: `serve.prefix.lookup`), `loads` / `on_read_done` (a disk hit is read in the background:
`serve.prefix.loads`), `attach` / `attached` / `detach` (a hit given to a request), `junction` /
`shared_prefix` / `expect` (where the adaptive policy cuts a prefill), `chunk_limit`, `on_computed` /
`on_finished` (checkpoints and block indexing), `evict_one` / `evictable`, `observe` / `apply` (what finished
in the background, applied at a step boundary: with several processes process 0 observes and every process
applies the same), `poll` (both, one process), `ledger` (its accounts: `serve.prefix.accounts`),
`forget_blocks`, `close`. The data it keeps comes from a CheckpointSource (the runner): the store decides
where to checkpoint (`serve.prefix.positions`), the writer takes the checkpoint (`serve.prefix.writer`), the
source copies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxhybrid.cache import CHECKPOINT_DTYPES
from serve.prefix.accounts import PrefixLedger, TierCounts
from serve.prefix.checkpoints import CheckpointTiers, KindTally
from serve.prefix.disk import DiskEntry, DiskNews, DiskTier, namespace
from serve.prefix.events import EventLog
from serve.prefix.index import BlockIndex, ChainHasher, TailIndex
from serve.prefix.loads import HitLoads, Load
from serve.prefix.lookup import Hit, Lookup
from serve.prefix.policies import POLICIES, make_policy
from serve.prefix.positions import CheckpointPositions
from serve.prefix.stats import LookupStats, MemoryStats
from serve.prefix.types import Checkpoint, CheckpointSource, Sequence_, Tier
from serve.prefix.writer import CheckpointWriter

CHECKPOINT_POLICIES = ("fixed", "adaptive")


@dataclasses.dataclass
class PrefixStoreConfig:
    enabled: bool = True
    checkpoint_interval: int = 32768
    prompt_end_checkpoints: bool = True
    sequence_end_checkpoints: bool = True
    device_bytes: int = 1 << 30
    host_bytes: int = 4 << 30
    store_dir: str | None = None  # disk tier (write-through) when set
    disk_bytes: int = 16 << 30
    disk_max_pending: int = 64  # saves queued at most; a checkpoint beyond that is not written
    disk_max_pending_bytes: int = 1 << 30  # and the device bytes those queued saves may hold
    max_tails: int = 16384  # partial blocks remembered (for how far a prompt matches), least recent dropped
    eviction: str | None = None  # the memory tiers' eviction policy (serve.prefix.policies); None: the
    # checkpoint policy's own ("lru" for fixed, "value" for adaptive)
    # "fixed" | "adaptive" (see the module doc); adaptive, the default, beat every fixed setting
    checkpoint_policy: str = "adaptive"
    # what a checkpoint keeps the KDA states in (`jaxhybrid.cache.CHECKPOINT_DTYPES`): float32 resumes
    # exactly; bfloat16 halves the recurrent state and rounds it once on resume
    checkpoint_dtype: str = "float32"
    events: bool = False  # keep KV and state events for a publisher (`take_events`; --kv-events-endpoint)
    # an offline placement (`serve.prefix.placement.Placement`, `bench prefix` only): with it the store
    # checkpoints at its positions and nowhere else
    placement: Any = None

    @property
    def eviction_policy(self) -> str:
        if self.eviction is not None:
            return self.eviction
        return "value" if self.adaptive else "lru"

    @property
    def adaptive(self) -> bool:
        return self.checkpoint_policy == "adaptive"

    @property
    def joint_eviction(self) -> bool:
        """KV blocks and checkpoints given up as one (`CheckpointTiers`): with the value eviction order."""
        return self.eviction_policy == "value"

    def aligned(self, block_size: int) -> PrefixStoreConfig:
        """This config with `checkpoint_interval` rounded to the nearest positive multiple of `block_size`
        (checkpoints sit on block boundaries), so that any block size works with the default interval."""
        if self.checkpoint_interval < 1:
            return self  # `validate` says what is wrong
        blocks = max(1, (self.checkpoint_interval + block_size // 2) // block_size)
        return dataclasses.replace(self, checkpoint_interval=blocks * block_size)

    def validate(self, block_size: int) -> None:
        if self.checkpoint_interval < 1 or self.checkpoint_interval % block_size:
            raise ValueError(
                f"checkpoint_interval ({self.checkpoint_interval}) must be a positive multiple of "
                f"the block size ({block_size})"
            )
        for name in ("device_bytes", "host_bytes", "disk_bytes", "disk_max_pending_bytes", "max_tails"):
            if getattr(self, name) < 0:
                raise ValueError(f"prefix store setting '{name}' must be >= 0")
        if self.disk_max_pending < 1:
            raise ValueError("prefix store setting 'disk_max_pending' must be >= 1")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction_policy!r} (known: {', '.join(POLICIES)})"
            )
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"unknown checkpoint policy {self.checkpoint_policy!r} "
                f"(known: {', '.join(CHECKPOINT_POLICIES)})"
            )
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(
                f"unknown checkpoint dtype {self.checkpoint_dtype!r} (known: {', '.join(CHECKPOINT_DTYPES)})"
            )
        if self.store_dir is not None and Path(self.store_dir).exists() and not Path(self.store_dir).is_dir():
            raise ValueError(f"prefix store directory '{self.store_dir}' is not a directory")


@dataclasses.dataclass
class Attachment:
    """A hit given to a request: `layout` per full block of the prefix (a shared pool block, or None where
    the request needs a fresh block filled with `fill_kv[:, j]`), and what goes into its slot."""

    hit: Hit
    layout: list[int | None]
    states: Any
    tail_kv: Any
    logits: Any = None
    fill_kv: Any = None  # per MLA layer [full blocks, block_size, latent] from disk


class PrefixStore:
    """The store the engine and the scheduler talk to (the methods the module doc lists). It decides and
    accounts; its collaborators hold the state and do the work: `blocks` (BlockIndex: cached KV blocks in the
    engine's pool) and `tails` (TailIndex: partial blocks, for how far a prompt matches), `checkpoints`
    (CheckpointTiers: states in device and host memory), `disk` (DiskTier, with `store_dir`), `lookup`
    (Lookup: finding and counting hits), `positions` (CheckpointPositions: where sequences are cut and
    checkpointed), `writer` (CheckpointWriter: taking those checkpoints), and `loads` (HitLoads, with a disk
    tier: disk hits read in the background, which the scheduler starts and finishes)."""

    def __init__(
        self,
        config: PrefixStoreConfig,
        *,
        block_size: int,
        block_bytes: int,
        state_bytes: int,
        fingerprint: bytes,
        allocator: Any,
        layout: str = "",
        peers: Any = None,
        restore_shardings: Any = None,
    ):
        """`peers` (sharding.multihost.Peers) and `restore_shardings(name, shape, dtype)`: several
        processes (see `serve.prefix.disk`)."""
        config.validate(block_size)
        self.config, self.block_size = config, block_size
        self.block_bytes, self.state_bytes = block_bytes, state_bytes
        self.fingerprint = fingerprint
        self.hasher = ChainHasher(fingerprint, block_size)
        self.events = EventLog() if config.events else None
        self.blocks = BlockIndex(allocator, block_size, self.events)
        self.tails = TailIndex(config.max_tails)
        self.lookups, self.memory_stats = LookupStats(), MemoryStats()
        self.checkpoints = CheckpointTiers(
            config.device_bytes,
            config.host_bytes,
            make_policy(config.eviction_policy),
            self.memory_stats,
            self.blocks if config.joint_eviction else None,
            self.events,
        )
        self.disk: DiskTier | None = None
        if config.store_dir is not None:  # entries are valid only for this model and cache layout
            self.disk = DiskTier(
                config.store_dir,
                namespace(fingerprint, layout),
                fingerprint,
                block_size,
                config.disk_bytes,
                config.disk_max_pending,
                config.disk_max_pending_bytes,
                peers=peers,
                restore_shardings=restore_shardings,
                log=self.events,
            )
            for entry in self.disk.entries.values():
                self._note_disk_tail(entry)
        self.lookup = Lookup(
            self.hasher, self.blocks, self.tails, self.checkpoints, self.disk, self.lookups, config.adaptive
        )
        self.loads = HitLoads(self.disk.reads) if self.disk is not None else None
        self.writer = CheckpointWriter(
            self.hasher,
            self.blocks,
            self.tails,
            self.checkpoints,
            self.disk,
            self.memory_stats,
            fingerprint,
            block_bytes,
            state_bytes,
        )
        self.positions = CheckpointPositions(
            interval=config.checkpoint_interval,
            adaptive=config.adaptive,
            states=(config.device_bytes + config.host_bytes) / state_bytes,
            block_size=block_size,
            prompt_end=config.prompt_end_checkpoints,
            sequence_end=config.sequence_end_checkpoints,
            placement=config.placement,
            writer=self.writer,
        )

    # --- matching --------------------------------------------------------------------------------------
    def find(self, seq: Sequence_) -> Hit:
        """Longest reusable prefix of `seq`'s tokens (`Lookup.find`), changing nothing but `seq.chain`: it is
        extended to all of its full blocks, so matching a request again hashes nothing again."""
        return self.lookup.find(seq.tokens, seq.cache_salt, seq.chain)

    def record(self, hit: Hit) -> None:
        """Count the lookup that found `hit`, once per admission or disk read started (`Lookup.record`)."""
        self.lookup.record(hit)

    # --- giving a hit to a request -------------------------------------------------------------------
    def attach(self, hit: Hit, load: Load | None = None) -> Attachment | None:
        """Hold the hit for a request: share its pool blocks (allocator references the request releases),
        pin its checkpoint; None when a disk hit's read failed (compute from scratch)."""
        alloc = self.blocks.allocator
        alloc.share(hit.blocks)
        if hit.disk is None:
            ck = hit.checkpoint
            ck.holders += 1
            self.checkpoints.hit(ck.key)
            return Attachment(hit, list(hit.blocks), ck.states, ck.tail_kv, ck.logits)
        if load is None or load.data is None or load.hit.disk is not hit.disk:
            alloc.release(hit.blocks)
            return None
        states, kv_full, tail = load.data
        layout: list[int | None] = list(hit.blocks)
        for h in hit.disk.block_hashes[len(layout) : hit.hit // self.block_size]:
            block = self.blocks.get(h)  # indexed by another sequence meanwhile: share it
            if block is not None:
                alloc.share([block])
            layout.append(block)
        return Attachment(hit, layout, states, tail, None, kv_full)

    def attached(self, seq: Sequence_, att: Attachment, source: CheckpointSource, t0: float) -> None:
        """The request holds the prefix now (its blocks filled, its slot restored): index a disk prefix's
        blocks, keep the disk hit in memory (host tier: it was read into host memory) for the next hit,
        count the restore."""
        hit = att.hit
        if hit.disk is not None:
            entry, n = hit.disk, hit.hit // self.block_size
            chain = self.hasher.extend(seq.chain, seq.tokens, seq.cache_salt, n)  # root + its hashes
            self.blocks.register(chain, seq.blocks[:n], tokens=seq.tokens)
            nbytes = self.state_bytes + (self.block_bytes if att.tail_kv is not None else 0)
            ck = Checkpoint(
                entry.key,
                entry.position,
                att.states,
                att.tail_kv,
                nbytes,
                Tier.HOST,
                entry.kind,
                chain=tuple(entry.block_hashes),
                tail=entry.tail,
            )
            self.checkpoints.add(ck, count=False)
            self.checkpoints.enforce(source.to_host)
            self.disk.touch(entry)
            self.disk.stats.restores += 1
            self.disk.stats.restore_time_s += time.perf_counter() - t0
        seq.checkpoint_base = hit.checkpoint.key if hit.checkpoint is not None else hit.disk.key
        self.memory_stats.restores += 1
        self.memory_stats.restore_time_s += time.perf_counter() - t0
        self.lookups.hits += 1
        self.lookups.hit_tokens += hit.hit
        self.lookups.recomputed_tokens += hit.recomputed
        self.detach(att)

    def detach(self, att: Attachment) -> None:
        """Unpin the hit's checkpoint (after `attached`, or when the request gave the hit up)."""
        if att.hit.checkpoint is not None and att.hit.checkpoint.holders > 0:
            att.hit.checkpoint.holders -= 1

    def missed(self, hit: Hit) -> None:
        """Count a lookup that reuses nothing (but may have matched tokens that get recomputed)."""
        self.lookups.recomputed_tokens += hit.recomputed

    # --- where checkpoints go: `CheckpointPositions` ---------------------------------------------------
    def chunk_limit(self, seq: Sequence_) -> int:
        """Tokens a prefill of `seq` may compute before its next checkpoint position."""
        return self.positions.chunk_limit(seq)

    def junction(self, seq: Sequence_, hit: Hit) -> int | None:
        """Where `seq` leaves the KV held beyond the state it resumes from (adaptive policy: a cut there)."""
        return self.positions.junction(seq, hit)

    def shared_prefix(self, seq: Sequence_, computing: list[Sequence_]) -> tuple[Sequence_, int] | None:
        """The running request `seq` should wait for (in-batch sharing), and where."""
        return self.positions.shared_prefix(seq, computing)

    def expect(self, waiting: Iterable[Sequence_], computing: list[Sequence_]) -> None:
        """Cut running requests where queued ones will leave them (the adaptive policy)."""
        self.positions.expect(waiting, computing)

    def on_computed(self, seq: Sequence_, source: CheckpointSource, logits: Any = None) -> None:
        """After `seq` computed up to seq.num_computed: the checkpoints due there (`logits`: the next-token
        logits, kept at a prompt end)."""
        self.positions.on_computed(seq, source, logits)

    def on_finished(self, seq: Sequence_, source: CheckpointSource) -> None:
        """A sequence ended normally: index its blocks, and keep its end state (sequence-end checkpoints)."""
        self.positions.on_finished(seq, source)

    @property
    def capacity(self) -> int:
        """Checkpoints the device and host budgets hold at most (each one state: a partial block's KV beside
        it is small)."""
        return (self.config.device_bytes + self.config.host_bytes) // self.state_bytes

    # --- KV blocks --------------------------------------------------------------------------------------
    def evictable(self) -> int:
        """Cached blocks only the store holds (what `evict_one` can free)."""
        return self.blocks.evictable()

    def evict_one(self) -> bool:
        """Free the least recently used cached block no request holds; False when there is none. With joint
        eviction a block no held checkpoint needs goes first; when every one is needed, the least valuable
        checkpoint ending a chain is given up with it (`CheckpointTiers.give_up`)."""
        h = self.blocks.evict_one()
        while h is None and self.checkpoints.give_up():
            h = self.blocks.evict_one()
        if h is None:
            h = self.blocks.evict_one(needed=True)
        if h is None:
            return False
        self.memory_stats.evicted_blocks += 1
        if self.disk is None or h not in self.disk.block_refs:  # a disk entry may still reach it
            self.tails.drop(h)
        return True

    def forget_blocks(self) -> None:
        """Drop every cached block (the pool was rebuilt); checkpoints are copies and stay."""
        self.blocks.forget_all()
        self.tails.clear()

    @property
    def held_blocks(self) -> list[int]:
        return self.blocks.held()

    # --- what finished in the background ----------------------------------------------------------------
    def on_read_done(self, fn: Callable[[], None] | None) -> None:
        """Call `fn()` (from the reader thread) whenever a disk read this store starts ends (`HitLoads`)."""
        if self.loads is not None:
            self.loads.on_done(fn)

    def observe(self) -> DiskNews | None:
        """What finished in the background (disk saves, the disk's state); None without a disk tier."""
        return None if self.disk is None else self.disk.observe()

    def apply(self, events: DiskNews | None) -> None:
        """Make what `observe` saw (on process 0) visible to lookups."""
        if self.disk is not None and events is not None:
            for entry in self.disk.apply(events):
                self._note_disk_tail(entry)

    def poll(self, wait: bool = False) -> None:
        """One process: make finished disk saves visible (waiting for all of them with `wait`)."""
        if self.disk is not None:
            for entry in self.disk.poll(wait=wait):
                self._note_disk_tail(entry)

    def _note_disk_tail(self, entry: DiskEntry) -> None:
        if entry.tail:
            self.tails.add(entry.base, entry.tail)

    def take_events(self) -> list[Any]:
        """The KV and state events since the last call, in order (none unless `config.events`)."""
        return [] if self.events is None else self.events.drain()

    # --- accounts ---------------------------------------------------------------------------------------
    def ledger(self, live_blocks: set[int]) -> PrefixLedger:
        """Bytes and counts per tier and per checkpoint kind and tier, and what reuse saved or cost (blocks in
        `live_blocks` count as live); the counters are copies."""
        cached = [b for b in self.held_blocks if b not in live_blocks]
        by_kind = self.checkpoints.tally(KindTally())
        counts, nbytes = TierCounts(), TierCounts()
        for tier in (Tier.DEVICE, Tier.HOST):
            counts.add(tier, self.checkpoints.count(tier))
            nbytes.add(tier, self.checkpoints.bytes(tier))
        disk_stats = disk_files = None
        if self.disk is not None:
            counts.disk, nbytes.disk = len(self.disk.entries), self.disk.bytes
            disk_stats, disk_files = dataclasses.replace(self.disk.stats), self.disk.ledger(by_kind)
        return PrefixLedger(
            checkpoints=counts,
            checkpoint_bytes=nbytes,
            checkpoints_by_kind=by_kind.counts,
            checkpoint_bytes_by_kind=by_kind.nbytes,
            cached_kv_blocks=len(cached),
            cached_kv_bytes=len(cached) * self.block_bytes,
            checkpoint_interval=self.config.checkpoint_interval,
            lookup=dataclasses.replace(self.lookups),
            memory=dataclasses.replace(self.memory_stats),
            disk=disk_stats,
            disk_files=disk_files,
        )

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

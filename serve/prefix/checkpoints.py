"""The prefix store's memory tiers: KDA state checkpoints on the device, demoted to host memory when the
device budget is exceeded and dropped when the host budget is, in the order an eviction policy gives
(never one a running request is restoring from)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from serve.prefix.accounts import TierCounts, by_kind
from serve.prefix.events import EventLog, StateRemoved, StateStored
from serve.prefix.index import BlockIndex
from serve.prefix.stats import MemoryStats
from serve.prefix.types import Checkpoint, CheckpointKind, EvictionPolicy, Tier


@dataclasses.dataclass
class KindTally:
    """Checkpoints of each kind in each tier: how many and their bytes (the ledger's by-kind part)."""

    counts: dict[CheckpointKind, TierCounts] = dataclasses.field(default_factory=by_kind)
    nbytes: dict[CheckpointKind, TierCounts] = dataclasses.field(default_factory=by_kind)

    def add(self, kind: CheckpointKind, tier: str, nbytes: int) -> None:
        self.counts[kind].add(tier, 1)
        self.nbytes[kind].add(tier, nbytes)


def stored_event(ck: Checkpoint) -> StateStored:
    """The event that announces `ck` in its tier."""
    return StateStored(ck.key, ck.position, ck.kind.value, ck.tier, ck.base, list(ck.tail), ck.nbytes)


class CheckpointTiers:
    """Checkpoints by key over the device and host tiers, within their byte budgets.

    With `blocks` (the store's BlockIndex: joint eviction), KV blocks and checkpoints are given up as one: the
    index knows which blocks a held checkpoint needs (`BlockIndex.hold`), a checkpoint whose blocks are gone
    (it resumes nothing) is the first to leave a tier, and when the pool needs a block that only checkpoints
    need, the least valuable checkpoint at the end of a chain gives its blocks up (`give_up`)."""

    def __init__(
        self,
        device_bytes: int,
        host_bytes: int,
        policy: EvictionPolicy,
        stats: MemoryStats,
        blocks: BlockIndex | None = None,
        log: EventLog | None = None,
    ):
        """`log`: where StateStored / StateRemoved go (`serve.prefix.events`)."""
        self.budgets = {Tier.DEVICE: device_bytes, Tier.HOST: host_bytes}
        self.policy, self.stats, self.blocks, self.log = policy, stats, blocks, log
        self._by_key: dict[bytes, Checkpoint] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(list(self._by_key.values()))

    def get(self, key: bytes) -> Checkpoint | None:
        return self._by_key.get(key)

    def used(self, key: bytes) -> None:
        self.policy.used(key)

    def hit(self, key: bytes) -> None:
        self.policy.hit(key)

    def looked_up(self) -> None:
        self.policy.looked_up()

    def dropped(self, key: bytes) -> bool:
        """Whether `key` was held and dropped lately (the policy remembers a few)."""
        return key not in self._by_key and self.policy.dropped(key)

    def missed(self, key: bytes) -> None:
        """A lookup would have resumed from the dropped checkpoint `key`."""
        self.policy.missed(key)

    def add(self, ck: Checkpoint, count: bool = True) -> bool:
        """Keep `ck` (replacing one under its key unless that one is being restored from); `count`: a new
        save (a checkpoint promoted from disk is not one)."""
        old = self._by_key.get(ck.key)
        if old is not None and old.holders:
            self.policy.used(ck.key)
            return False
        if self.blocks is not None:
            self.blocks.hold(ck.chain)
            if old is not None:
                self.blocks.unhold(old.chain)
        self._by_key[ck.key] = ck
        self.policy.inserted(ck)
        if self.log is not None:
            if old is not None and old.tier != ck.tier:
                self.log.add(StateRemoved(old.key, old.tier))
            self.log.add(stored_event(ck))
        if count:
            self.stats.saves += 1
        return True

    def bytes(self, tier: str) -> int:
        return sum(c.nbytes for c in self._by_key.values() if c.tier == tier)

    def count(self, tier: str) -> int:
        return sum(1 for c in self._by_key.values() if c.tier == tier)

    def tally(self, into: KindTally) -> KindTally:
        """Add every checkpoint's bytes to `into`, by kind and tier."""
        for c in self._by_key.values():
            into.add(c.kind, c.tier, c.nbytes)
        return into

    def resumable(self, ck: Checkpoint) -> bool:
        """Whether the KV below `ck` is still cached (always, without joint eviction)."""
        return self.blocks is None or ck.base is None or ck.base in self.blocks

    def _order(self) -> list[bytes]:
        """The policy's order, checkpoints that resume nothing first (joint eviction)."""
        order = list(self.policy.order())
        if self.blocks is None:
            return order
        return sorted(order, key=lambda k: self.resumable(self._by_key[k]))  # stable: False first

    def _drop(self, key: bytes) -> None:
        ck = self._by_key.pop(key)
        self.policy.removed(key)
        if self.log is not None:
            self.log.add(StateRemoved(key, ck.tier))
        if self.blocks is not None:
            self.blocks.unhold(ck.chain)
        self.stats.dropped_checkpoints += 1

    def give_up(self) -> bool:
        """Joint eviction, when the pool needs a block and every evictable one is needed by a checkpoint:
        drop the first checkpoint in the policy's order that ends its chain (no other held checkpoint needs
        its last block) and whose last block is evictable, so that its blocks can go; False if none."""
        if self.blocks is None:
            return False
        for key in self._order():
            ck = self._by_key[key]
            if (
                not ck.holders
                and ck.base is not None
                and self.blocks.needed_by(ck.base) == 1
                and self.blocks.evictable_hash(ck.base)
            ):
                self._drop(key)
                return True
        return False

    def enforce(self, to_host: Callable[[Any], Any]) -> None:
        """Demote device checkpoints to the host while over the device budget, then drop host ones while
        over the host budget, in the policy's order (with joint eviction, those that resume nothing first)."""
        for tier in (Tier.DEVICE, Tier.HOST):
            used = self.bytes(tier)
            for key in self._order():
                if used <= self.budgets[tier]:
                    break
                ck = self._by_key[key]
                if ck.tier != tier or ck.holders:
                    continue
                used -= ck.nbytes
                if tier == Tier.DEVICE and ck.nbytes <= self.budgets[Tier.HOST] and self.resumable(ck):
                    ck.states, ck.tail_kv = to_host(ck.states), to_host(ck.tail_kv)
                    ck.logits = None if ck.logits is None else to_host(ck.logits)
                    ck.tier = Tier.HOST
                    self.stats.demotions += 1
                    if self.log is not None:
                        self.log.add(StateRemoved(key, Tier.DEVICE))
                        self.log.add(stored_event(ck))
                else:
                    self._drop(key)

"""The prefix store's memory tiers: KDA state checkpoints on the device, demoted to host memory when the
device budget is exceeded and dropped when the host budget is, in the order an eviction policy gives
(never one a running request is restoring from)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

from serve.prefix.policies import EvictionPolicy
from serve.prefix.stats import MemoryStats


class Tier:
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"  # the write-through copies (`serve.prefix.disk`), not a tier a Checkpoint lives in


TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class CheckpointKind(StrEnum):
    """Why the store took a checkpoint; the value is what disk metadata records. Where several are due at
    one position the first in this order is it (one checkpoint per position)."""

    INTERVAL = "interval"  # a multiple of the checkpoint interval
    PROMPT_END = "prompt_end"  # the end of a prompt (keeps its next-token logits)
    SEQUENCE_END = "sequence_end"  # the last computed position of a finished sequence
    JUNCTION = "junction"  # where a prompt leaves a prefix others hold or compute (adaptive policy)


@dataclasses.dataclass
class KindTally:
    """Checkpoints of each kind in each tier: how many and their bytes (the ledger's by-kind part)."""

    counts: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {k.value: dict.fromkeys(TIERS, 0) for k in CheckpointKind}
    )
    nbytes: dict[str, dict[str, int]] = dataclasses.field(
        default_factory=lambda: {k.value: dict.fromkeys(TIERS, 0) for k in CheckpointKind}
    )

    def add(self, kind: CheckpointKind, tier: str, nbytes: int) -> None:
        self.counts[kind.value][tier] += 1
        self.nbytes[kind.value][tier] += nbytes

    def ledger(self) -> dict[str, dict[str, dict[str, int]]]:
        return {"checkpoints_by_kind": self.counts, "checkpoint_bytes_by_kind": self.nbytes}


@dataclasses.dataclass
class Checkpoint:
    """KDA states after `position` tokens (+ the partial last block's KV when position % block_size)."""

    key: bytes
    position: int
    states: Any  # per KDA layer (conv, state): device arrays, or numpy on the host tier
    tail_kv: Any  # per MLA layer [block_size, latent] (first position % block_size rows valid), or None
    nbytes: int
    tier: str  # Tier.DEVICE | Tier.HOST
    kind: CheckpointKind
    holders: int = 0  # running requests restoring from it right now (never evicted while > 0)
    logits: Any = (
        None  # [vocab] next-token logits at `position` (prompt ends): an identical prompt hits fully
    )
    parent: bytes | None = None  # the checkpoint before it on its chain (where its request resumed or last
    # saved), for what it saves (`serve.prefix.policies.ValueAware`)


class CheckpointTiers:
    """Checkpoints by key over the device and host tiers, within their byte budgets."""

    def __init__(self, device_bytes: int, host_bytes: int, policy: EvictionPolicy, stats: MemoryStats):
        self.budgets = {Tier.DEVICE: device_bytes, Tier.HOST: host_bytes}
        self.policy, self.stats = policy, stats
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
        self._by_key[ck.key] = ck
        self.policy.inserted(ck)
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

    def enforce(self, to_host: Callable[[Any], Any]) -> None:
        """Demote device checkpoints to the host while over the device budget, then drop host ones while
        over the host budget, in the policy's order."""
        for tier in (Tier.DEVICE, Tier.HOST):
            used = self.bytes(tier)
            for key in self.policy.order():
                if used <= self.budgets[tier]:
                    break
                ck = self._by_key[key]
                if ck.tier != tier or ck.holders:
                    continue
                used -= ck.nbytes
                if tier == Tier.DEVICE and ck.nbytes <= self.budgets[Tier.HOST]:
                    ck.states, ck.tail_kv = to_host(ck.states), to_host(ck.tail_kv)
                    ck.logits = None if ck.logits is None else to_host(ck.logits)
                    ck.tier = Tier.HOST
                    self.stats.demotions += 1
                else:
                    del self._by_key[key]
                    self.policy.removed(key)
                    self.stats.dropped_checkpoints += 1

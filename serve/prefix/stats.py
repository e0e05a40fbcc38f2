"""Typed counters of the prefix store, one dataclass per part. The store counts into them; its ledger
(`serve.prefix.accounts.PrefixLedger`) carries copies, flattened on the boundary under the names the
metrics and benchmarks read (disk counters with a `disk_` prefix)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LookupStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0


@dataclasses.dataclass
class MemoryStats:
    """The device and host tiers, and the KV blocks the store keeps in the engine's pool."""

    saves: int = 0
    save_time_s: float = 0.0
    restores: int = 0
    restore_time_s: float = 0.0
    demotions: int = 0  # device -> host
    dropped_checkpoints: int = 0
    evicted_blocks: int = 0


@dataclasses.dataclass
class DiskStats:
    saves: int = 0
    save_time_s: float = 0.0
    restores: int = 0
    restore_time_s: float = 0.0
    dropped: int = 0  # removed for the budget
    skipped: int = 0  # not written: queue full, or the disk was full
    save_errors: int = 0
    restore_errors: int = 0
    collected: int = 0  # leftovers of interrupted saves removed at open
    full: int = 0  # saves that found the disk full
    last_error: str | None = None

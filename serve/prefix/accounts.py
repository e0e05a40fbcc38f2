"""The prefix store's accounts as one typed record (`PrefixLedger`, what `PrefixStore.ledger` returns): the
checkpoints and cached KV it holds, per tier and per checkpoint kind, and its counters (`serve.prefix.stats`).
Inside a process it travels as an object and is read by field; `to_json` gives the flat object of the
process boundary (/health, /metrics, the benchmarks' JSON), whose names the metrics and benchmarks read,
and `from_json` reads it back (a ledger that crossed a boundary, or several replicas' summed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from serve.prefix.stats import DiskStats, LookupStats, MemoryStats
from serve.prefix.types import CheckpointKind


@dataclasses.dataclass
class TierCounts:
    """One number per tier: checkpoints held, or their bytes (disk: the write-through copies)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    def add(self, tier: str, n: int) -> None:
        """Add `n` to `tier`'s number (`serve.prefix.types.Tier`: "device", "host" or "disk")."""
        setattr(self, tier, getattr(self, tier) + n)

    def total(self) -> int:
        return self.device + self.host + self.disk

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, int]) -> TierCounts:
        return cls(**data)


def by_kind() -> dict[CheckpointKind, TierCounts]:
    """Zeros for every checkpoint kind (the ledger lists every kind, held or not)."""
    return {k: TierCounts() for k in CheckpointKind}


@dataclasses.dataclass
class DiskFiles:
    """The disk tier's own part of the ledger: saves on their way (not yet committed, so not in the tier's
    counts) and files it found but does not index, and where it keeps them."""

    pending: int  # saves queued or being written
    pending_bytes: int
    ignored: int  # names in the directory that were not complete entries when it opened
    store_dir: str


# the counters' names on the boundary: the store's without a prefix, the disk tier's with `disk_`
DISK_PREFIX = "disk_"


@dataclasses.dataclass(frozen=True)
class PrefixLedger:
    """What the prefix store holds and what reuse saved or cost. `PrefixLedger()` is nothing held: what an
    engine without a store reports (its counters, interval and disk parts None, so its JSON has only the
    holdings). The counters are copies: a ledger is a snapshot, the store's keep counting."""

    checkpoints: TierCounts = dataclasses.field(default_factory=TierCounts)
    checkpoint_bytes: TierCounts = dataclasses.field(default_factory=TierCounts)
    checkpoints_by_kind: dict[CheckpointKind, TierCounts] = dataclasses.field(default_factory=by_kind)
    checkpoint_bytes_by_kind: dict[CheckpointKind, TierCounts] = dataclasses.field(default_factory=by_kind)
    cached_kv_blocks: int = 0  # KV blocks the store keeps that no running request holds
    cached_kv_bytes: int = 0
    checkpoint_interval: int | None = None  # the store's (None: no store)
    lookup: LookupStats | None = None  # None: no store
    memory: MemoryStats | None = None  # the device and host tiers' counters (None: no store)
    disk: DiskStats | None = None  # the disk tier's counters (None: no disk tier)
    disk_files: DiskFiles | None = None  # None: no disk tier

    def to_json(self) -> dict[str, Any]:
        """The flat object of the boundary, in the order it has always had: holdings, counters (disk's with
        `disk_`, its last error only when there is one), the interval, the disk tier's own part."""
        out: dict[str, Any] = {
            "cached_kv_blocks": self.cached_kv_blocks,
            "cached_kv_bytes": self.cached_kv_bytes,
            "checkpoint_bytes": self.checkpoint_bytes.to_json(),
            "checkpoints": self.checkpoints.to_json(),
            "checkpoints_by_kind": {k.value: c.to_json() for k, c in self.checkpoints_by_kind.items()},
            "checkpoint_bytes_by_kind": {
                k.value: c.to_json() for k, c in self.checkpoint_bytes_by_kind.items()
            },
        }
        for part in (self.lookup, self.memory):
            if part is not None:
                out.update(dataclasses.asdict(part))
        if self.disk is not None:
            disk = dataclasses.asdict(self.disk)
            out.update({DISK_PREFIX + k: v for k, v in disk.items() if v is not None})
        if self.checkpoint_interval is not None:
            out["checkpoint_interval"] = self.checkpoint_interval
        if self.disk_files is not None:
            files = self.disk_files
            out.update(
                {
                    DISK_PREFIX + "pending": files.pending,
                    DISK_PREFIX + "pending_bytes": files.pending_bytes,
                    DISK_PREFIX + "ignored": files.ignored,
                    "store_dir": files.store_dir,
                }
            )
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrefixLedger:
        """`to_json`'s inverse. A part is there when its first name is (`lookups`, `saves`, `disk_saves`,
        `checkpoint_interval`, `store_dir`); a name it does not know is an error."""
        left = dict(data)

        def part(kind: type, prefix: str = "") -> Any:
            names = [prefix + f.name for f in dataclasses.fields(kind)]
            if names[0] not in left:
                return None
            return kind(**{n.removeprefix(prefix): left.pop(n) for n in names if n in left})

        def kinds(key: str) -> dict[CheckpointKind, TierCounts]:
            return {CheckpointKind(k): TierCounts.from_json(c) for k, c in left.pop(key).items()}

        out = cls(
            checkpoints=TierCounts.from_json(left.pop("checkpoints")),
            checkpoint_bytes=TierCounts.from_json(left.pop("checkpoint_bytes")),
            checkpoints_by_kind=kinds("checkpoints_by_kind"),
            checkpoint_bytes_by_kind=kinds("checkpoint_bytes_by_kind"),
            cached_kv_blocks=left.pop("cached_kv_blocks"),
            cached_kv_bytes=left.pop("cached_kv_bytes"),
            checkpoint_interval=left.pop("checkpoint_interval", None),
            lookup=part(LookupStats),
            memory=part(MemoryStats),
            disk=part(DiskStats, DISK_PREFIX),
            disk_files=None
            if "store_dir" not in left
            else DiskFiles(
                left.pop(DISK_PREFIX + "pending"),
                left.pop(DISK_PREFIX + "pending_bytes"),
                left.pop(DISK_PREFIX + "ignored"),
                left.pop("store_dir"),
            ),
        )
        if left:
            raise ValueError(f"not in a prefix ledger: {sorted(left)}")
        return out

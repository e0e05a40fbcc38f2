"""The engine's typed records: what a step takes from the background (`StepEvents`) and what the engine
reports of itself (`Ledger`, `MemoryReport`). They travel as objects inside a process; `to_json` /
`from_json` are for the process boundary only (the step log sent to other processes, the HTTP server's
/health and /metrics, the CLI's and the benchmarks' JSON)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from serve.prefix.store import DiskNews, PrefixLedger


class LoadOutcome(NamedTuple):
    """How a prefix read from disk ended, as process 0 saw it (every process follows it)."""

    request_id: str
    ok: bool  # the read gave the request its prefix
    transient: bool  # it failed for a reason that may pass (the entry is kept)


@dataclasses.dataclass(frozen=True)
class StepEvents:
    """What finished in the background since the last step: the only input of a step that depends on time.
    With several processes process 0 observes it and every process applies the same at the same step."""

    disk: DiskNews | None = None  # the disk tier's news; None: no disk tier, or nothing observed
    loaded: tuple[LoadOutcome, ...] = ()  # disk reads that ended, in arrival order

    def has_news(self) -> bool:
        """Whether applying these changes anything (else a step log need not carry them)."""
        if self.loaded:
            return True
        return self.disk is not None and self.disk.has_news()

    def to_json(self) -> dict[str, Any]:
        disk = None if self.disk is None else self.disk.to_json()
        return {"disk": disk, "loaded": [list(x) for x in self.loaded]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepEvents:
        disk = None if data["disk"] is None else DiskNews.from_json(data["disk"])
        return cls(disk, tuple(LoadOutcome(*x) for x in data["loaded"]))


NO_EVENTS = StepEvents()  # nothing finished in the background


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Every byte the running requests and the prefix store hold, and what reuse saved or cost."""

    live_kv_bytes: int  # KV blocks of running requests
    live_state_bytes: int  # KDA states of running requests
    prefix_cache: bool  # whether the engine has a prefix store
    # The store's accounts (`serve.prefix.store.PrefixStore.ledger`; `PrefixLedger()`, nothing held, without
    # a store): cached KV, checkpoints and their bytes per tier and per kind, lookups, hits, saves, evictions.
    prefix: PrefixLedger
    disk_loading: int | None = None  # requests waiting for a prefix read from disk (None: no store)

    def to_json(self) -> dict[str, Any]:
        """One flat object: the engine's fields, then the store's accounts."""
        out = {
            "live_kv_bytes": self.live_kv_bytes,
            "live_state_bytes": self.live_state_bytes,
            "prefix_cache": self.prefix_cache,
            **self.prefix.to_json(),
        }
        if self.disk_loading is not None:
            out["disk_loading"] = self.disk_loading
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ledger:
        """`to_json`'s inverse (a ledger that crossed a boundary, or several replicas' summed)."""
        prefix = dict(data)
        live_kv, live_state = prefix.pop("live_kv_bytes"), prefix.pop("live_state_bytes")
        has_store, loading = prefix.pop("prefix_cache"), prefix.pop("disk_loading", None)
        return cls(live_kv, live_state, has_store, PrefixLedger.from_json(prefix), loading)


@dataclasses.dataclass(frozen=True)
class RequestMemory:
    """What one running request holds."""

    blocks: int
    kv_bytes: int
    state_bytes: int
    tokens: int  # positions computed


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes held by the engine: KV blocks (used/free), KDA states (the pool, the live ones), per running
    request, and the weights."""

    block_size: int
    block_bytes: int
    num_blocks: int  # usable blocks (the scratch block not counted)
    used_blocks: int
    free_blocks: int
    kv_bytes_total: int
    kv_bytes_used: int
    kv_bytes_free: int
    slots: int
    state_bytes_per_slot: int
    state_pool_bytes: int
    live_states: int
    state_bytes_live: int
    requests: dict[str, RequestMemory]
    model_bytes: int  # the weights as held
    draft_model_bytes: int | None = None  # a draft model's weights and pools (None: no draft model)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.draft_model_bytes is None:
            del out["draft_model_bytes"]
        return out

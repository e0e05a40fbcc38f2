"""What an engine holds, as records: the memory ledger (`Ledger`: live bytes and the prefix store's
accounts), the bytes of its pools and weights (`MemoryReport`), and the prefix store's events and capacity.
A view over the scheduler and the pools it is given: it keeps nothing of its own."""

from __future__ import annotations

from typing import Any

from serve.engine.drafting import DraftModel
from serve.engine.pools import EnginePools
from serve.engine.records import Ledger, MemoryReport
from serve.engine.scheduler import Scheduler


class Accounts:
    """See the module doc. `model_bytes`: the weights as held; `draft`: the draft model, if any."""

    def __init__(self, scheduler: Scheduler, pools: EnginePools, model_bytes: int, draft: DraftModel | None):
        self.scheduler, self.pools, self.model_bytes, self.draft = scheduler, pools, model_bytes, draft

    def ledger(self) -> Ledger:
        """Every byte the running requests and the prefix store hold, and what reuse saved or cost."""
        return self.scheduler.ledger()

    def memory(self) -> MemoryReport:
        """Bytes held: KV blocks (used/free), KDA states (the pool, the live ones), per running request, the
        weights (and the draft model's weights and pools)."""
        alloc, shape, running = self.pools.allocator, self.pools.shape, self.scheduler.running
        return MemoryReport(
            block_size=shape.block_size,
            block_bytes=shape.block_bytes,
            num_blocks=alloc.usable,
            used_blocks=alloc.num_used,
            free_blocks=alloc.num_free,
            kv_bytes_total=alloc.usable * shape.block_bytes,
            kv_bytes_used=alloc.num_used * shape.block_bytes,
            kv_bytes_free=alloc.num_free * shape.block_bytes,
            slots=shape.slots,
            state_bytes_per_slot=shape.state_bytes,
            state_pool_bytes=shape.slots * shape.state_bytes,
            live_states=len(running),
            state_bytes_live=len(running) * shape.state_bytes,
            requests={r.id: self.scheduler.memory_of(r) for r in running},
            model_bytes=self.model_bytes,
            draft_model_bytes=None if self.draft is None else self.draft.held_bytes(),
        )

    def take_events(self) -> list[Any]:
        """The prefix store's KV and state events since the last call (`serve.prefix.events`; none without a
        store or without `PrefixStoreConfig.events`)."""
        store = self.pools.store
        return [] if store is None else store.take_events()

    def checkpoint_capacity(self) -> int | None:
        """Checkpoints the prefix store keeps in device and host memory at most (None: no store); a router
        reads it from /health to spread conversations over replicas whose stores can keep them."""
        store = self.pools.store
        return None if store is None else store.capacity

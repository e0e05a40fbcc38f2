"""What an engine holds on its devices: the KV block allocator, the runner (cache pools and compiled model
programs) and the prefix store wired to both; compiling programs ahead of use, rebuilding the pools after a
program call that consumed them, and the bytes they hold. The engine's step loop uses these; this keeps
them and their account."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jaxhybrid.model import HybridLM
from serve.engine.blocks import BlockAllocator
from serve.engine.config import EngineShape, ProgramShape
from serve.engine.requests import Request
from serve.engine.runner import Runner
from serve.prefix.fingerprint import model_fingerprint
from serve.prefix.store import PrefixStore, PrefixStoreConfig
from sharding.multihost import Peers

log = logging.getLogger("jaxhybrid.engine")


def aligned_prefix(prefix: PrefixStoreConfig, block_size: int) -> PrefixStoreConfig:
    """`prefix` with its checkpoint interval rounded to a multiple of `block_size`, said in one log line."""
    aligned = prefix.aligned(block_size)
    if aligned.checkpoint_interval != prefix.checkpoint_interval:
        log.info(
            "checkpoint interval %d -> %d tokens: rounded to a multiple of the block size (%d)",
            prefix.checkpoint_interval,
            aligned.checkpoint_interval,
            block_size,
        )
    return aligned


def disk_layout(shape: EngineShape) -> str:
    """What the disk tier's entries are valid for besides the model: the block size, the KV dtype and (when
    not exact) the checkpoints' dtype, so that an exact store never resumes from a rounded state."""
    layout = f"bs{shape.block_size}-{shape.kv_dtype.name}"
    return layout if shape.checkpoint_dtype == "float32" else f"{layout}-ck{shape.checkpoint_dtype}"


class EnginePools:
    """See the module doc. `mesh`: the mesh the model is sharded over (the pools are laid out on it)."""

    def __init__(self, shape: EngineShape, allocator: BlockAllocator, runner: Any, store: PrefixStore | None):
        """`runner`: a `Runner`, or one with its step interface and no model (`serve.sim.runner`)."""
        self.shape, self.allocator, self.runner, self.store = shape, allocator, runner, store

    @classmethod
    def for_model(
        cls, model: HybridLM, shape: EngineShape, prefix: PrefixStoreConfig | None, mesh: Any
    ) -> EnginePools:
        allocator = BlockAllocator(shape.num_blocks)
        runner = Runner(model, shape, mesh)
        store = None
        if prefix is not None and prefix.enabled:
            peers = Peers()
            if peers.several and prefix.store_dir is not None:
                runner.init_restore_shardings()
            store = PrefixStore(
                prefix,
                block_size=shape.block_size,
                block_bytes=shape.block_bytes,
                state_bytes=shape.checkpoint_bytes,
                fingerprint=model_fingerprint(model),
                allocator=allocator,
                layout=disk_layout(shape),
                peers=peers,
                restore_shardings=runner.restore_sharding,
            )
        return cls(shape, allocator, runner, store)

    def rebuild_lost(self) -> None:
        """If a failed program call consumed the pools: rebuild them (the prefix store then forgets its KV
        blocks; its checkpoints are copies and stay)."""
        if self.runner.pools_lost():
            log.warning("rebuilding the cache pools after a failed program call")
            if self.store is not None:
                self.store.forget_blocks()
            self.runner.rebuild()

    def compile_program(self, program: ProgramShape, run_once: bool) -> bool:
        """`Runner.compile_program`, the pools rebuilt if the run took them."""
        return self._ahead(lambda: self.runner.compile_program(program, run_once=run_once))

    def compile_helpers(
        self, rows: tuple[int, ...] | None, run_once: bool, slot_programs: bool = True
    ) -> None:
        """`Runner.compile_helpers` for batches of `rows` (None: every batch size a step can have)."""
        rows = tuple(sorted({1, *self.shape.decode_buckets})) if rows is None else rows
        self._ahead(lambda: self.runner.compile_helpers(rows, run_once=run_once, slot_programs=slot_programs))

    def _ahead(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            self.rebuild_lost()  # a failed run took the (idle) pools with it
            raise

    def memory(self, running: list[Request], memory_of: Callable[[Request], dict]) -> dict[str, Any]:
        """Bytes held: KV blocks (used/free), live KDA states, and per running request (`memory_of`)."""
        alloc, shape, live = self.allocator, self.shape, len(running)
        return {
            "block_size": shape.block_size,
            "block_bytes": shape.block_bytes,
            "num_blocks": alloc.usable,
            "used_blocks": alloc.num_used,
            "free_blocks": alloc.num_free,
            "kv_bytes_total": alloc.usable * shape.block_bytes,
            "kv_bytes_used": alloc.num_used * shape.block_bytes,
            "kv_bytes_free": alloc.num_free * shape.block_bytes,
            "slots": shape.slots,
            "state_bytes_per_slot": shape.state_bytes,
            "state_pool_bytes": shape.slots * shape.state_bytes,
            "live_states": live,
            "state_bytes_live": live * shape.state_bytes,
            "requests": {r.id: memory_of(r) for r in running},
        }

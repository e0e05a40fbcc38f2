"""What an engine holds on its devices: the KV block allocator, the runner (cache pools and compiled model
programs) and the prefix store wired to both; compiling programs ahead of use, and rebuilding the pools
after a program call that consumed them. `EnginePools.build` makes them for the engine and the simulator
alike; the engine's step loop uses them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from jaxhybrid.model import HybridLM
from serve.engine.blocks import BlockAllocator
from serve.engine.config import EngineShape, ProgramShape
from serve.engine.executables import Tier
from serve.engine.runner import Runner, StepRunner
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
    """See the module doc. `runner`: a `Runner`, or one with its step interface and no model (the
    simulator's, `serve.sim.runner`); `build` makes the allocator and the store around it."""

    def __init__(
        self, shape: EngineShape, allocator: BlockAllocator, runner: StepRunner, store: PrefixStore | None
    ):
        self.shape, self.allocator, self.runner, self.store = shape, allocator, runner, store

    @classmethod
    def for_model(
        cls, model: HybridLM, shape: EngineShape, prefix: PrefixStoreConfig | None, mesh: Any
    ) -> EnginePools:
        """A `Runner` of `model` (on `mesh`, the mesh the model is sharded over) and what `build` adds."""
        runner = Runner(model, shape, mesh)
        peers = Peers()
        if prefix is not None and prefix.enabled and peers.several and prefix.store_dir is not None:
            runner.copies.init_restore_shardings()
        fingerprint = model_fingerprint(model)
        return cls.build(shape, runner, prefix, fingerprint, peers, runner.copies.restore_sharding)

    @classmethod
    def build(
        cls,
        shape: EngineShape,
        runner: StepRunner,
        prefix: PrefixStoreConfig | None,
        fingerprint: bytes,
        peers: Peers | None = None,
        restore_shardings: Callable[[str, tuple[int, ...], str], Any] | None = None,
    ) -> EnginePools:
        """The block allocator, and with `prefix` enabled the prefix store over it, around `runner`: the
        engine's and the simulator's. `fingerprint`: what the store's keys (and disk entries) are valid for;
        `peers` and `restore_shardings`: a disk tier shared by several processes (`serve.prefix.disk`)."""
        allocator = BlockAllocator(shape.num_blocks)
        store = None
        if prefix is not None and prefix.enabled:
            store = PrefixStore(
                prefix,
                block_size=shape.block_size,
                block_bytes=shape.block_bytes,
                state_bytes=shape.checkpoint_bytes,
                fingerprint=fingerprint,
                allocator=allocator,
                layout=disk_layout(shape),
                peers=peers,
                restore_shardings=restore_shardings,
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

    def compile_in_background(self, program: ProgramShape, tier: Tier) -> Future:
        """`Runner.compile_in_background`: `program` compiled on the background compile thread."""
        return self.runner.compile_in_background(program, tier)

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

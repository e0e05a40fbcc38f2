"""Compiling a runner's programs ahead of their first use: what the warm-up calls (`Runner`'s base)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.cache import SCRATCH_BLOCK
from serve.engine import copies
from serve.engine.config import ProgramShape
from serve.engine.executables import Tier


class AheadOfTime:
    """The warm-up's side of a `Runner`: which programs are compiled, and compiling more, at a tier, on this
    thread or the background one. Uses the runner's pools, programs and executables."""

    model_config: Any
    pools: Any
    pool_shardings: Any
    programs: Any
    params: Any
    _executables: Any

    def compiled_programs(self) -> frozenset[ProgramShape]:
        """The model-program shapes this runner has run or compiled (calling one compiles nothing)."""
        return self._executables.shapes()

    def optimized_programs(self) -> frozenset[ProgramShape]:
        """The model-program shapes whose optimized form is ready (the rest are quick, or not compiled)."""
        return frozenset(p for p in self._executables.shapes() if self._executables.optimized(p))

    def compile_program(
        self, program: ProgramShape, run_once: bool = False, tier: Tier = Tier.OPTIMIZED
    ) -> bool:
        """Compile the model program of `program`'s shape at `tier` (or better) ahead of its first use; False
        if it already was. Only shapes are looked at, not the pools' contents.

        With `run_once` (only while no request holds a slot) the program also runs once, on rows with no
        real token whose block tables point at the scratch block: XLA:CPU's first run of a program costs more
        than later ones, and the first request should not pay that either."""
        fresh = self._executables.compile(program, *self._ahead_args(program), tier)
        if fresh and run_once and not program.verify:
            rows = program.rows
            jax.block_until_ready(
                self.run_program(
                    np.zeros((rows, program.length), np.int32),
                    np.arange(rows, dtype=np.int32),  # distinct slots, as a decode step's padding rows take
                    np.full((rows, program.width), SCRATCH_BLOCK, np.int32),
                    np.zeros((rows,), np.int32),
                    np.zeros((rows,), np.int32),  # no real token in any row
                )
            )
        return fresh

    def compile_in_background(self, program: ProgramShape, tier: Tier) -> concurrent.futures.Future:
        """Trace `program` here and compile it at `tier` on the background compile thread: a future of
        `compile_program`'s bool (done at once when nothing was left to compile)."""
        return self._executables.compile(program, *self._ahead_args(program), tier, background=True)

    def _ahead_args(self, program: ProgramShape) -> tuple[str, Any, tuple[Any, ...]]:
        """(name, jitted model function, its arguments as shapes) of `program`."""
        rows = program.rows
        run, params = (self.programs.verify, self.params) if program.verify else self._program(program.length)
        kda, mla = self._split_specs()
        ints = [(rows, program.length), (rows,), (rows, program.width), (rows,), (rows,)]
        args = tuple(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ints)
        if program.verify:  # each position's sampling settings and key, as `Runner.verify` passes them
            n = rows * program.length
            f32, i32 = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32)
            keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))
            args += (f32, i32, f32, keys)
        return self._program_name(run), run, (params, kda, mla, *args)

    def compile_helpers(
        self, sample_rows: tuple[int, ...], run_once: bool = False, slot_programs: bool = True
    ) -> None:
        """Compile the small programs around the model program: sampling for each batch of `sample_rows` (and
        its verify window's keys where requests speculate by default), logits slicing, and with
        `slot_programs` a checkpoint's copy, a slot reset and a restore (the last two also run on slot 0 with
        `run_once`, only while no request holds a slot)."""
        vocab = self.model_config.vocab_size
        for rows in sample_rows:
            logits = self._run_like_logits(rows, vocab)
            self.sample(logits, [None] * rows)
            if self.shape.speculates:  # a verify step's sampling keys: one per position of its window
                self._greedy_arrays(rows * (self.shape.speculative_tokens + 1))
            # a prompt-end checkpoint keeps logits[0]; a full hit samples [None] of that
            jax.block_until_ready(logits[0][None])
        if not slot_programs:
            return
        slot, scratch = jnp.int32(0), jnp.int32(SCRATCH_BLOCK)
        states, kv = self.take(0, SCRATCH_BLOCK)
        if run_once:
            self.pools = copies.put(copies.zero_slot(self.pools, slot), slot, states, scratch, kv)
            jax.block_until_ready(self.pools)
        else:
            copies.zero_slot.lower(self.pools, slot).compile()
            copies.put.lower(self.pools, slot, states, scratch, kv).compile()

    def _run_like_logits(self, rows: int, vocab: int) -> jax.Array:
        """Zero logits [rows, vocab] placed as the model program leaves them (replicated on a mesh)."""
        logits = jnp.zeros((rows, vocab), jnp.float32)
        if self.pool_shardings is None:
            return jax.device_put(logits, jax.devices()[0])
        mesh = jax.tree.leaves(self.pool_shardings)[0].mesh
        return jax.device_put(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

"""The runner: the cache pools, the compiled programs and their shardings. It executes what the scheduler
planned (slot resets, prefix restores, the decode batch, prefill chunks) and gives the prefix store the
copies it keeps (`take`, `gather`); it decides nothing.

Pools: per KDA layer a state pool indexed by slot, per MLA layer a paged latent pool addressed through
block tables. Programs are compiled once per static shape: one decode step over all slots and one prefill
program per bucketed chunk length, each per block-table width bucket.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.cache import (
    SCRATCH_BLOCK,
    KDACache,
    KDAPoolInPlace,
    KDAPoolRows,
    MLAView,
    PagedMLACache,
    kda_zero_state,
)
from jaxhybrid.layers.mla import read_paged, write_paged
from jaxhybrid.model import HybridLM
from jaxhybrid.ops.kda import steps_into_pools
from jaxhybrid.ops.placement import platform_of
from jaxhybrid.ops.stacks import set_rows
from jaxhybrid.scan import ScanDefs, forward_scanned, scan_layout, split_for_scan
from serve.engine import copies
from serve.engine.compiles import Compiles, Programs, split_pools
from serve.engine.config import EngineShape, ProgramShape, scan_mode
from serve.engine.executables import ExecutableCache, ModelExecutables, Tier, spec
from serve.engine.requests import Request
from serve.engine.sampling import batch_arrays, greedy, sample, verify
from serve.engine.store_copies import HostShards, StoreCopies, to_device
from serve.prefix.store import CheckpointSource
from sharding.placement import pool_shardings

# The longest prompt chunk that runs through the decode program while its prefill program compiles
# (`EngineConfig.tiered_compile`): one decode step per token is milliseconds for a model a CPU serves, against
# seconds of compiling.
STEP_PREFILL_MAX = 16


@dataclasses.dataclass
class Restore:
    """Device copies that put a prefix hit into a request's slot before it runs: the checkpoint's KDA
    states, its partial block's KV (into `tail_block`, or nothing), and for a hit read from disk the KV
    of the full blocks the pool lacked (`fill_blocks` [n] <- `fill_kv` per MLA layer [n, block, latent])."""

    slot: int
    states: Any
    tail_block: int = SCRATCH_BLOCK
    tail_kv: Any = None
    fill_blocks: list[int] = dataclasses.field(default_factory=list)
    fill_kv: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Last:
    """What a model program gives for each row's last real token: its logits [B, V] f32 and the greedy token
    [B] int32 with its logprob [B] f32 (a step whose rows are all greedy needs no sampling program)."""

    logits: jax.Array
    greedy_ids: jax.Array
    greedy_logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class Verified:
    """What verifying drafted tokens gave, per request: tokens [n, T] (its accepted drafts, then the token
    drawn after them; the rest meaningless), their logprobs [n, T], accepted [n] drafts."""

    tokens: np.ndarray
    logprobs: np.ndarray
    accepted: np.ndarray


class StepRunner(Protocol):
    """What the engine's step loop needs of a runner: this module's `Runner`, or one that computes nothing
    (the simulator's `SimRunner`). `copies`: where the prefix store takes its checkpoints from."""

    copies: CheckpointSource

    def reset_slot(self, slot: int) -> None: ...

    def restore(self, r: Restore) -> None: ...

    def decode(self, reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]: ...

    def verify(self, reqs: list[Request], drafts: list[list[int]]) -> Verified: ...

    def prefill_rows(self, reqs: list[Request], ns: list[int]) -> Any: ...

    def sample(self, logits: Any, rows: list[Request | None]) -> tuple[np.ndarray, np.ndarray]: ...

    def compiled_programs(self) -> frozenset[ProgramShape]: ...

    def pools_lost(self) -> bool: ...


def _write_rows(kda_pools: tuple[KDACache, ...], slot_ids: jax.Array, rows: tuple[KDACache, ...]) -> Any:
    return tuple(
        KDACache(
            conv=p.conv.at[slot_ids].set(r.conv.astype(p.conv.dtype)),
            state=p.state.at[slot_ids].set(r.state.astype(p.state.dtype)),
        )
        for p, r in zip(kda_pools, rows, strict=True)
    )


def _run_fn(model_def: Any, layer_types: tuple[str, ...], in_place: bool = False) -> Any:
    """The `run` program's function: `model_def` an nnx GraphDef (params: the model's state) or, for the
    scanned form, `ScanDefs` (params: `ScanParams`). The scanned form reads each MLA layer's rows' view
    (`MLAView`) before the scan and writes the new latents into the pools after it: the pools themselves
    are not scan inputs, and each write still depends on its read (so the pool is updated in place).
    `in_place` (unrolled, one token per row): the program writes its rows' KDA states into the pools
    itself. Returns (`Last`, rows' KDA states, (), MLA pools); with `in_place` (`Last`, (), KDA pools, MLA
    pools)."""
    scanned = isinstance(model_def, ScanDefs)

    def run(params, kda_pools, mla_pools, tokens, slot_ids, block_tables, start, num_valid):
        if in_place and (scanned or tokens.shape[1] != 1):
            raise ValueError("only an unrolled one-token program writes its rows in place")
        cache = row_caches(
            layer_types, kda_pools, mla_pools, slot_ids, block_tables, start, scanned, in_place
        )
        if scanned:
            logits, new = forward_scanned(model_def, params, tokens, cache, num_valid)
        else:
            model = nnx.merge(model_def, params)
            logits, new = model.forward_cached(tokens, cache, num_valid)
        rows = tuple(c for kind, c in zip(layer_types, new, strict=True) if kind == "kda")
        mla_new = tuple(c for kind, c in zip(layer_types, new, strict=True) if kind != "kda")
        if scanned:
            new_mla = tuple(
                write_paged(PagedMLACache(pool, block_tables, start), w.new, num_valid)
                for pool, w in zip(mla_pools, mla_new, strict=True)
            )
        else:
            new_mla = tuple(c.pool for c in mla_new)
        if logits.shape[1] == 1:  # a decode step: no gather (take_along_axis's selects over the whole row)
            logits = logits[:, 0].astype(jnp.float32)
        else:
            last = jnp.maximum(num_valid - 1, 0)[:, None, None]
            logits = jnp.take_along_axis(logits, last, axis=1)[:, 0].astype(jnp.float32)
        if in_place:
            return Last(logits, *greedy(logits)), (), rows, new_mla
        return Last(logits, *greedy(logits)), rows, (), new_mla

    return run


def row_caches(
    layer_types: tuple[str, ...],
    kda_pools: Any,
    mla_pools: Any,
    slot_ids: jax.Array,
    block_tables: jax.Array,
    start: jax.Array,
    scanned: bool = False,
    in_place: bool = False,
) -> tuple[Any, ...]:
    """Per layer the cache the rows of a program call read: their slots' KDA states (as rows of the pool,
    `KDAPoolRows`, for the unrolled form; the pools to update in place, `KDAPoolInPlace`, with `in_place`),
    and the MLA pools through their block tables (as a read view for the scanned form)."""
    kda_it, mla_it = iter(kda_pools), iter(mla_pools)
    cache = []
    for kind in layer_types:
        if kind == "kda":
            pool = next(kda_it)
            if scanned:
                cache.append(KDACache(conv=pool.conv[slot_ids], state=pool.state[slot_ids]))
            elif in_place:
                cache.append(KDAPoolInPlace(conv=pool.conv, state=pool.state, rows=slot_ids))
            else:
                cache.append(KDAPoolRows(conv=pool.conv[slot_ids], state=pool.state, rows=slot_ids))
        elif scanned:
            cache.append(MLAView(view=read_paged(next(mla_it), block_tables), length=start))
        else:
            cache.append(PagedMLACache(pool=next(mla_it), block_table=block_tables, length=start))
    return tuple(cache)


def _verify_fn(model_def: Any, layer_types: tuple[str, ...], in_place: bool = False) -> Any:
    """The `verify` program's function: `run` for rows that hold their last sampled token and then their
    drafted tokens (`num_valid` = 1 + drafts), with `sampling.verify` deciding which drafts stand. Every KDA
    layer keeps its state after every token; the rows' new states are those after each row's last accepted
    token, so the rows' write leaves every slot as if it had decoded only the accepted tokens. Returns
    ((tokens [B, T], logprobs [B, T], accepted [B]), rows' states, (), MLA pools); with `in_place` the
    program sets those states into the KDA pools itself (`stacks.set_rows`) and returns ((...), (), KDA
    pools, MLA pools). The KV written past a row's accepted tokens lies beyond its length, where the next
    step writes over it."""

    def verify_rows(
        params,
        kda_pools,
        mla_pools,
        tokens,
        slot_ids,
        block_tables,
        start,
        num_valid,
        temp,
        top_k,
        top_p,
        keys,
    ):
        cache = row_caches(layer_types, kda_pools, mla_pools, slot_ids, block_tables, start)
        model = nnx.merge(model_def, params)
        logits, new = model.forward_cached(tokens, cache, num_valid, keep_states=True)
        num_drafts = jnp.maximum(num_valid - 1, 0)
        out = verify(logits, tokens[:, 1:], num_drafts, temp, top_k, top_p, keys)
        at = out[2]
        pick = lambda x: jnp.take_along_axis(x, at.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]  # noqa: E731
        rows = tuple(
            KDACache(conv=pick(c.conv), state=pick(c.state))
            for kind, c in zip(layer_types, new, strict=True)
            if kind == "kda"
        )
        mla = tuple(c.pool for kind, c in zip(layer_types, new, strict=True) if kind != "kda")
        if in_place:
            pools = tuple(
                KDACache(conv=set_rows(p.conv, slot_ids, r.conv), state=set_rows(p.state, slot_ids, r.state))
                for p, r in zip(kda_pools, rows, strict=True)
            )
            return out, (), pools, mla
        return out, rows, (), mla

    return verify_rows


@functools.lru_cache(maxsize=16)
def _programs(
    graphdef: Any,
    layer_types: tuple[str, ...],
    pool_shardings: Any = None,
    scan: ScanDefs | None = None,
    in_place: bool = False,
) -> Programs:
    """The Programs jitted once per model structure (and scanned form, and pool layout on a mesh, where they
    keep the pools in their shardings; and whether a one-token step writes its KDA rows in place)."""
    fns = [_run_fn(graphdef, layer_types), _verify_fn(graphdef, layer_types)]
    fns += [_run_fn(scan, layer_types)] if scan is not None else []
    if pool_shardings is None:
        run = jax.jit(fns[0], donate_argnums=(2,))
        scanned_run = jax.jit(fns[2], donate_argnums=(2,)) if scan is not None else None
        # in place, the KDA pools (argument 1) are donated and written too; the MLA pools (2) always
        donate = (1, 2) if in_place else (2,)
        writes = jax.jit(_run_fn(graphdef, layer_types, True), donate_argnums=donate) if in_place else None
        verify_ = jax.jit(_verify_fn(graphdef, layer_types, in_place), donate_argnums=donate)
        write_rows = jax.jit(_write_rows, donate_argnums=(0,))
        return Programs(run, write_rows, jax.jit(sample), verify_, scanned_run, writes)
    kda_shardings = tuple(s for kind, s in zip(layer_types, pool_shardings, strict=True) if kind == "kda")
    mla_shardings = tuple(s for kind, s in zip(layer_types, pool_shardings, strict=True) if kind != "kda")
    # Logits and sampled ids replicated: every process reads them (a mesh may span several processes); the
    # rows' states where the program leaves them (None: unconstrained).
    replicated = jax.sharding.NamedSharding(
        jax.tree.leaves(pool_shardings)[0].mesh, jax.sharding.PartitionSpec()
    )
    out = (replicated, None, None, mla_shardings)
    run, verify_, *scanned = [jax.jit(fn, donate_argnums=(2,), out_shardings=out) for fn in fns]
    return Programs(
        run,
        jax.jit(_write_rows, donate_argnums=(0,), out_shardings=kda_shardings),
        jax.jit(sample, out_shardings=replicated),
        verify_,
        *scanned,
    )


def empty_pools(cfg: Any, shape: EngineShape) -> tuple[Any, ...]:
    """The engine's pools, zero, unplaced: per layer a `KDACache` [slots, ...] or an MLA latent pool
    [num_blocks, block_size, latent] (under `jax.eval_shape`: what the engine allocates, for planning)."""
    return tuple(
        kda_zero_state(cfg, shape.slots, shape.kv_dtype)
        if kind == "kda"
        else jnp.zeros((shape.num_blocks, shape.block_size, cfg.latent_dim), shape.kv_dtype)
        for kind in cfg.layer_types
    )


def _table(req: Any, width: int) -> np.ndarray:
    """`req`'s block table padded to `width` with the scratch block."""
    row = np.full((width,), SCRATCH_BLOCK, np.int32)
    row[: len(req.blocks)] = req.blocks
    return row


def _row_inputs(
    slots: int, reqs: list[Request], chunks: list[list[int]], program: ProgramShape
) -> tuple[np.ndarray, ...]:
    """(tokens, slot ids, block tables, start, valid) of `program` with row i holding `chunks[i]`, the
    tokens at `reqs[i]`'s next positions. Padding rows take distinct slots outside the call with no real
    token and scratch tables: their state and cache stay unchanged. `slots`: the engine's."""
    busy = [r.slot for r in reqs]
    others = [s for s in range(slots) if s not in busy]
    slot_ids = np.asarray(busy + others[: program.rows - len(reqs)], np.int32)
    tokens = np.zeros((program.rows, program.length), np.int32)
    tables = np.full((program.rows, program.width), SCRATCH_BLOCK, np.int32)
    start = np.zeros((program.rows,), np.int32)
    valid = np.zeros((program.rows,), np.int32)
    for i, (req, chunk) in enumerate(zip(reqs, chunks, strict=True)):
        tokens[i, : len(chunk)] = chunk
        tables[i] = _table(req, program.width)
        start[i], valid[i] = req.num_computed, len(chunk)
    return tokens, slot_ids, tables, start, valid


class Runner:
    """Pools + programs for one model and one EngineShape (on `mesh` when given: the pools are laid out by
    `sharding.placement.pool_shardings` and the programs keep them there). It owns the pools; `compiles`
    (which compiled program runs a shape) and `copies` (the prefix store's copies) are its collaborators."""

    def __init__(self, model: HybridLM, shape: EngineShape, mesh: Any = None):
        self.shape = shape
        self.model_config = cfg = model.config
        graphdef, state = nnx.split(model)
        self.graphdef = graphdef  # the model's static structure (a subclass's programs merge it too)
        # plain nested dicts of arrays: a call flattens them in C++, where a State of nnx Variables is
        # flattened in Python, one Variable at a time, which a decode step of a small model would notice
        self.params = state.to_pure_dict()
        # The scanned form (`shape.scan_layers`, resolved by `scan_mode`), built once here, never inside a
        # program: with "prefill" the prefill programs run it and decode the unrolled layers, with "all" all.
        layout = scan_layout(model) if shape.scan_layers != "off" else None
        self.scan_mode = scan_mode(shape.scan_layers, layout.groups if layout else 0)
        if self.scan_mode == "off":
            layout = None
        scan_defs, self.scan_params = split_for_scan(model, layout) if layout else (None, None)
        self.pool_shardings = None
        if mesh is not None:
            self.pool_shardings = pool_shardings(
                cfg, mesh, slots=shape.slots, num_blocks=shape.num_blocks, block_size=shape.block_size
            )
        self.pools = self._new_pools()
        # a one-token step writes its rows' KDA states into the pools itself where kernels do so in place
        kda_pools, _ = self._split_pools()
        in_place = self.pool_shardings is None and steps_into_pools(platform_of(self.pools))
        in_place = in_place and all(p.conv.dtype == p.state.dtype == jnp.float32 for p in kda_pools)
        self.programs = _programs(graphdef, cfg.layer_types, self.pool_shardings, scan_defs, in_place)
        self._greedy: dict[int, tuple[Any, ...]] = {}  # `_greedy_arrays` by size
        # the compiled model programs by shape, read from the compile cache's executables when it has them
        structure = lambda: repr((graphdef, scan_defs, cfg.layer_types))  # noqa: E731
        cache = ExecutableCache.from_jax_config()
        executables = ModelExecutables(
            self.programs.write_rows, structure, cache, tiered=shape.tiered_compile
        )
        self.compiles = Compiles(
            self.programs,
            self.params,
            self.scan_params,
            self.scan_mode,
            cfg.layer_types,
            spec(self.pools),  # what a compile needs of the pools, on any thread
            executables,
        )
        self.copies = StoreCopies(shape, self.pool_shardings, lambda: self.pools)

    def _new_pools(self) -> tuple[Any, ...]:
        pools = empty_pools(self.model_config, self.shape)
        # placed (committed) as the programs return them, so the first call compiles what every later one uses
        return jax.device_put(pools, self.pool_shardings or jax.devices()[0])

    # --- what the scheduler planned ------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """Zero a slot's KDA state so a newly admitted request starts from the empty state."""
        self.pools = copies.zero_slot(self.pools, jnp.int32(slot))

    def restore(self, r: Restore) -> None:
        cfg, shape = self.model_config, self.shape
        if r.fill_blocks:
            n = len(r.fill_blocks)
            width = shape.table_width(n)
            ids = np.full((width,), SCRATCH_BLOCK, np.int32)
            ids[:n] = r.fill_blocks
            rows = jnp.pad(jnp.asarray(r.fill_kv), [(0, 0), (0, width - n)] + [(0, 0)] * (r.fill_kv.ndim - 2))
            kv_rows = tuple(rows[i] for i in range(rows.shape[0]))
            self.pools = copies.put_blocks(self.pools, jnp.asarray(ids), kv_rows)
        kv = r.tail_kv
        if kv is None:
            kv = tuple(
                jnp.zeros((shape.block_size, cfg.latent_dim), shape.kv_dtype)
                for _ in range(cfg.num_mla_layers)
            )
        is_host = lambda x: isinstance(x, HostShards)  # noqa: E731
        states = jax.tree_util.tree_map(to_device, r.states, is_leaf=is_host)
        kv = jax.tree_util.tree_map(to_device, kv, is_leaf=is_host)
        self.pools = copies.put(self.pools, jnp.int32(r.slot), states, jnp.int32(r.tail_block), kv)

    def run_program(
        self,
        tokens: np.ndarray,
        slot_ids: np.ndarray,
        tables: np.ndarray,
        start: np.ndarray,
        valid: np.ndarray,
    ) -> Last:
        """Run `tokens` [B, T] for slots `slot_ids` (block tables [B, W], positions from `start`, `valid` real
        tokens per row); updates the pools, returns what the program gives for each row's last real token."""
        program = ProgramShape(*tokens.shape, tables.shape[1])
        host = (tokens, slot_ids, tables, start, valid)
        return self._execute(program, self.compiles.select(program.length), host)

    def _execute(
        self, program: ProgramShape, fn: tuple[Any, Any], host: tuple[np.ndarray, ...], extra: tuple = ()
    ) -> Any:
        """Call the model program `fn` (jitted function, its parameters) compiled for `program` on the host
        arrays (tokens, slot ids, block tables, start, valid) and `extra` device arguments; write the rows'
        states and take the new pools. Returns the program's first output."""
        kda, mla = self._split_pools()
        # int32 on the host: no conversion on the device. On one device a compiled call takes host arrays for
        # a fifth of what placing them first costs (jnp.asarray); on a mesh they are placed first.
        ints = tuple(np.asarray(a, np.int32) for a in host)
        if self.pool_shardings is not None:
            ints = tuple(jnp.asarray(a) for a in ints)
        tokens_, slots, tables_, start_, valid_ = ints
        inputs = (*fn, kda, mla, tokens_, slots, tables_, start_, valid_, *extra)
        run, write_rows = self.compiles.get(program, inputs)
        out, rows, written, mla = run(*inputs[1:])
        self._set_pools(write_rows(kda, slots, rows) if rows else written, mla)
        return out

    def _set_pools(self, kda: tuple[Any, ...], mla: tuple[Any, ...]) -> None:
        """The engine's pools from the KDA and the MLA pools (`_split_pools`' inverse), in layer order."""
        kda_it, mla_it = iter(kda), iter(mla)
        self.pools = tuple(
            next(kda_it) if kind == "kda" else next(mla_it) for kind in self.model_config.layer_types
        )

    def _split_pools(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(KDA state pools, MLA latent pools), each in layer order (what a model program reads, donates)."""
        return split_pools(self.model_config.layer_types, self.pools)

    def decode(self, reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """One decode step for `reqs`: the sampled id and its logprob per request, in order.

        The program runs `decode_rows(len(reqs))` rows, not every slot: idle slots cost nothing. Padding
        rows take distinct idle slots with no real token, which leaves their state unchanged."""
        rows = self.shape.decode_rows(len(reqs))
        width = self.shape.table_width(max(len(r.blocks) for r in reqs))
        program = ProgramShape(rows, 1, width)
        last = self.run_program(
            *_row_inputs(self.shape.slots, reqs, [[r.tokens[r.num_computed]] for r in reqs], program)
        )
        if all(r.params.greedy for r in reqs):
            ids, logps = jax.device_get((last.greedy_ids, last.greedy_logprobs))
        else:
            ids, logps = self.sample(last.logits, [*reqs, *([None] * (rows - len(reqs)))])
        return ids[: len(reqs)], logps[: len(reqs)]

    def verify(self, reqs: list[Request], drafts: list[list[int]]) -> Verified:
        """One decode step for `reqs` in which row i also carries `drafts[i]` (up to
        `shape.speculative_tokens` tokens proposed to follow its last sampled one, possibly none): one call
        of the `verify` program (`_verify_fn`) for all rows. Each slot ends at its last accepted token."""
        shape, n = self.shape, len(reqs)
        rows = shape.decode_rows(n)
        width = shape.table_width(max(len(r.blocks) for r in reqs))
        program = ProgramShape(rows, shape.speculative_tokens + 1, width, verify=True)
        host = _row_inputs(
            self.shape.slots,
            reqs,
            [[r.tokens[r.num_computed], *d] for r, d in zip(reqs, drafts, strict=True)],
            program,
        )
        if all(r.params.greedy for r in reqs):  # no key, filter or temperature changes a greedy row's tokens
            sampling = self._greedy_arrays(rows * program.length)
        else:
            per_position = [(r, i) for r in [*reqs, *([None] * (rows - n))] for i in range(program.length)]
            sampling = batch_arrays(
                [None if r is None else r.params for r, _ in per_position],
                [0 if r is None else r.seed for r, _ in per_position],
                [0 if r is None else len(r.generated) + i for r, i in per_position],
            )
        out = self._execute(program, (self.programs.verify, self.params), host, sampling)
        tokens, logps, accepted = (a[:n] for a in jax.device_get(out))  # one transfer for the three
        return Verified(tokens, logps, accepted)

    def _greedy_arrays(self, positions: int) -> tuple[Any, ...]:
        """`batch_arrays` for `positions` greedy positions (made once per size, kept with the runner: a step
        of greedy rows only skips building its keys)."""
        if positions not in self._greedy:
            self._greedy[positions] = batch_arrays([None] * positions, [0] * positions, [0] * positions)
        return self._greedy[positions]

    def prefill_rows(self, reqs: list[Request], ns: list[int]) -> jax.Array:
        """The next `ns[i]` tokens of each of `reqs` (distinct slots) in one call: one row, or the packed
        program (`EngineShape.packed`) for two or more chunks that pack. The logits [rows, V] after each row's
        last token."""
        if len(reqs) == 1:
            program = ProgramShape(1, self.shape.bucket(ns[0]), self.shape.table_width(len(reqs[0].blocks)))
            tiered = self.shape.tiered_compile and ns[0] <= STEP_PREFILL_MAX
            if tiered and not self.compiles.ready(program):
                return self._prefill_by_steps(reqs[0], ns[0], program)
        else:
            if len(reqs) > self.shape.prefill_rows or not all(
                self.shape.packs(n, len(r.blocks)) for r, n in zip(reqs, ns, strict=True)
            ):
                raise ValueError(f"these {len(reqs)} prefill chunks cannot share a call")
            program = self.shape.packed(max(ns))
        return self._run_rows(reqs, ns, program)

    def _prefill_by_steps(self, req: Request, n: int, program: ProgramShape) -> jax.Array:
        """A short chunk whose prefill program is not ready: its `n` tokens one at a time through the one-row
        decode program (the same states and KV, within round-off), while `program` compiles in the
        background. The logits [1, V] after its last token."""
        self.compiles.soon(program)
        table, slot, one = _table(req, program.width)[None], np.asarray([req.slot]), np.ones(1, np.int32)
        for position in range(req.num_computed, req.num_computed + n):
            token = np.asarray([[req.tokens[position]]], np.int32)
            logits = self.run_program(token, slot, table, np.asarray([position]), one).logits
        return logits

    def _run_rows(self, reqs: list[Request], ns: list[int], program: ProgramShape) -> jax.Array:
        """Run `program` with row i holding the next `ns[i]` tokens of `reqs[i]`."""
        chunks = [r.tokens[r.num_computed : r.num_computed + n] for r, n in zip(reqs, ns, strict=True)]
        return self.run_program(*_row_inputs(self.shape.slots, reqs, chunks, program)).logits

    def sample(self, logits: jax.Array, rows: list[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        params = [None if r is None else r.params for r in rows]
        seeds = [0 if r is None else r.seed for r in rows]
        steps = [0 if r is None else len(r.generated) for r in rows]
        temperature, top_k, top_p, keys = batch_arrays(params, seeds, steps)
        ids, logps = self.programs.sample(logits, temperature, top_k, top_p, keys)
        return np.asarray(ids), np.asarray(logps)

    # --- ahead of use (the warm-up) --------------------------------------------------------------------
    def compiled_programs(self) -> frozenset[ProgramShape]:
        """The model-program shapes this runner has run or compiled (calling one compiles nothing)."""
        return self.compiles.shapes()

    def compile_in_background(self, program: ProgramShape, tier: Tier) -> concurrent.futures.Future:
        """Trace `program` here and compile it at `tier` on the background compile thread: a future of
        `compile_program`'s bool (done at once when nothing was left to compile)."""
        return self.compiles.compile(program, tier, background=True)

    def compile_program(
        self, program: ProgramShape, run_once: bool = False, tier: Tier = Tier.OPTIMIZED
    ) -> bool:
        """Compile the model program of `program`'s shape at `tier` (or better) ahead of its first use; False
        if it already was. With `run_once` (only while no request holds a slot) the program also runs once,
        on rows with no real token whose block tables point at the scratch block: XLA:CPU's first run of a
        program costs more than later ones, and the first request should not pay that either."""
        fresh = self.compiles.compile(program, tier)
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

    def compile_helpers(
        self, sample_rows: tuple[int, ...], run_once: bool = False, slot_programs: bool = True
    ) -> None:
        """Compile the small programs around the model program: sampling for each batch of `sample_rows` (and
        its verify window's keys where requests speculate by default), logits slicing, and with
        `slot_programs` a checkpoint's copy, a slot reset and a restore (the last two also run on slot 0 with
        `run_once`, only while no request holds a slot)."""
        for rows in sample_rows:
            logits = self._zero_logits(rows)
            self.sample(logits, [None] * rows)
            if self.shape.speculates:  # a verify step's sampling keys: one per position of its window
                self._greedy_arrays(rows * (self.shape.speculative_tokens + 1))
            # a prompt-end checkpoint keeps logits[0]; a full hit samples [None] of that
            jax.block_until_ready(logits[0][None])
        if not slot_programs:
            return
        slot, scratch = jnp.int32(0), jnp.int32(SCRATCH_BLOCK)
        states, kv = self.copies.take(0, SCRATCH_BLOCK)
        if run_once:
            self.pools = copies.put(copies.zero_slot(self.pools, slot), slot, states, scratch, kv)
            jax.block_until_ready(self.pools)
        else:
            copies.zero_slot.lower(self.pools, slot).compile()
            copies.put.lower(self.pools, slot, states, scratch, kv).compile()

    def _zero_logits(self, rows: int) -> jax.Array:
        """Zero logits [rows, vocab] placed as the model program leaves them (replicated on a mesh)."""
        logits = jnp.zeros((rows, self.model_config.vocab_size), jnp.float32)
        if self.pool_shardings is None:
            return jax.device_put(logits, jax.devices()[0])
        mesh = jax.tree.leaves(self.pool_shardings)[0].mesh
        return jax.device_put(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    # --- failures --------------------------------------------------------------------------------------
    def pools_lost(self) -> bool:
        """Whether a failed program consumed (donated) the pools without returning new ones."""
        return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.pools))

    def rebuild(self) -> None:
        """New, empty pools (after `pools_lost`)."""
        self.pools = self._new_pools()

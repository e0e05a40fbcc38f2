"""The serving engine: cache pools, compiled programs, a continuous-batching scheduler, sampling.

The engine owns one state pool per KDA layer (indexed by slot) and one paged latent pool per MLA layer
(addressed through per-request block tables). It compiles a fixed set of programs once: one decode step
over all slots, and one prefill program per bucketed chunk length. Between steps, the scheduler admits
waiting requests into free slots, mixes prefill chunks with the decode batch under a token budget,
frees slots and blocks of finished requests, and preempts (then later recomputes) the newest request
when blocks run out.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import itertools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.cache import SCRATCH_BLOCK, KDACache, PagedMLACache, kda_state_bytes, kda_zero_state
from jaxhybrid.config import ModelConfig
from jaxhybrid.model import HybridLM
from serve.engine.blocks import BlockAllocator
from serve.engine.sampling import SamplingError, SamplingParams, batch_arrays, sample
from serve.prefix.store import Checkpoint, Lookup, PrefixStore, PrefixStoreConfig, fingerprint

log = logging.getLogger("jaxhybrid.engine")

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
MAX_SALT_CHARS = 256  # a salt enters every block hash of its request: keep it short


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the problem. Nothing was changed."""


def check_cache_salt(salt: object) -> None:
    """Raise RequestError unless `salt` is None or a non-empty string of at most MAX_SALT_CHARS characters
    that UTF-8 can encode (a lone surrogate cannot)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise RequestError("cache_salt must be a non-empty string")
    if len(salt) > MAX_SALT_CHARS:
        raise RequestError(f"cache_salt must be at most {MAX_SALT_CHARS} characters, got {len(salt)}")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("cache_salt must be valid Unicode text (it holds a lone surrogate)") from None


@dataclasses.dataclass
class EngineConfig:
    """Engine shape. Either `num_blocks` or `kv_memory_bytes` sizes the KV pool (default: room for every
    slot at `max_model_len`)."""

    max_slots: int = 4
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    prefill_chunk: int = 128
    max_model_len: int | None = None
    max_batched_tokens: int | None = None
    kv_dtype: str = "float32"
    seed: int = 0
    prefix: PrefixStoreConfig | None = dataclasses.field(default_factory=PrefixStoreConfig)

    def validate(self) -> None:
        for name in ("max_slots", "block_size", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"engine setting '{name}' must be a positive integer, got {value!r}")
        for name in ("num_blocks", "kv_memory_bytes", "max_model_len", "max_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"engine setting '{name}' must be a positive integer or unset, got {value!r}"
                )
        if self.num_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("set either num_blocks or kv_memory_bytes, not both")


@dataclasses.dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    status: str = WAITING
    slot: int | None = None
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    order: int = -1
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    preemptions: int = 0
    cache_salt: str | None = None
    stored_logits: Any = None  # next-token logits restored with a full prefix hit (nothing left to prefill)
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    loading: tuple[Any, cf.Future] | None = None  # (disk entry, its read in progress) while it waits for it
    preloaded: tuple[bytes, Any] | None = None  # (entry key, what the read gave: arrays or None)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        """Tokens whose KV/state is not in the cache yet."""
        return len(self.prompt) + len(self.generated) - self.num_computed

    def stats(self) -> dict[str, Any]:
        return {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": len(self.generated),
            "prefill_tokens_computed": self.prefill_tokens,
            "prefill_time_s": self.prefill_time,
            "decode_time_s": self.decode_time,
            "time_to_first_token_s": None
            if self.first_token_time is None
            else self.first_token_time - self.arrival,
            "total_time_s": None if self.finish_time is None else self.finish_time - self.arrival,
            "preemptions": self.preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request (the streaming unit)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens reused from the prefix store
    error: str | None = None  # set with finish_reason "error": the engine failed this request


@dataclasses.dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    stats: dict[str, Any]


def prefill_buckets(prefill_chunk: int, smallest: int = 16) -> tuple[int, ...]:
    """Static prefill lengths: powers of two from `smallest` up to, and including, `prefill_chunk`."""
    sizes = [s for s in (2**i for i in range(4, 31)) if smallest <= s < prefill_chunk]
    return (*sizes, prefill_chunk)


def table_buckets(max_blocks: int) -> tuple[int, ...]:
    """Static block-table widths: powers of two below `max_blocks`, then `max_blocks` itself."""
    return (*(w for w in (2**i for i in range(31)) if w < max_blocks), max_blocks)


@functools.lru_cache(maxsize=16)
def _programs(graphdef: Any, layer_types: tuple[str, ...], pool_shardings: Any = None) -> tuple[Any, Any]:
    """(run, sample) jitted once per model structure (and pool layout on a mesh); `run` donates the pools,
    and on a mesh keeps them in their shardings."""

    def run(params, pools, tokens, slot_ids, block_tables, start, num_valid):
        model = nnx.merge(graphdef, params)
        cache = tuple(
            KDACache(conv=pool.conv[slot_ids], state=pool.state[slot_ids])
            if kind == "kda"
            else PagedMLACache(pool=pool, block_table=block_tables, length=start)
            for kind, pool in zip(layer_types, pools, strict=True)
        )
        logits, new = model.forward_cached(tokens, cache, num_valid)
        new_pools = tuple(
            KDACache(
                conv=pool.conv.at[slot_ids].set(c.conv.astype(pool.conv.dtype)),
                state=pool.state.at[slot_ids].set(c.state.astype(pool.state.dtype)),
            )
            if kind == "kda"
            else c.pool
            for kind, pool, c in zip(layer_types, pools, new, strict=True)
        )
        last = jnp.maximum(num_valid - 1, 0)[:, None, None]
        return jnp.take_along_axis(logits, last, axis=1)[:, 0].astype(jnp.float32), new_pools

    if pool_shardings is None:
        return jax.jit(run, donate_argnums=(1,)), jax.jit(sample)
    # Logits and sampled ids replicated: every process reads them (a mesh may span several processes).
    replicated = jax.sharding.NamedSharding(
        jax.tree.leaves(pool_shardings)[0].mesh, jax.sharding.PartitionSpec()
    )
    return (
        jax.jit(run, donate_argnums=(1,), out_shardings=(replicated, pool_shardings)),
        jax.jit(sample, out_shardings=replicated),
    )


@jax.jit
def _take(
    pools: tuple[Any, ...], slot: jax.Array, block: jax.Array
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Copies of one slot's KDA states and one block's latent KV (a checkpoint's content)."""
    states = tuple((p.conv[slot], p.state[slot]) for p in pools if isinstance(p, KDACache))
    kv = tuple(p[block] for p in pools if not isinstance(p, KDACache))
    return states, kv


@jax.jit
def _gather(pools: tuple[Any, ...], blocks: jax.Array) -> tuple[Any, ...]:
    """Copies of the latent KV of `blocks` [n], per MLA layer [n, block_size, latent] (a disk entry)."""
    return tuple(p[blocks] for p in pools if not isinstance(p, KDACache))


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_blocks(pools: tuple[Any, ...], blocks: jax.Array, kv: tuple[Any, ...]) -> tuple[Any, ...]:
    """Write per MLA layer [n, block_size, latent] KV into `blocks` [n] (a prefix loaded from disk)."""
    kv_it = iter(kv)
    return tuple(p if isinstance(p, KDACache) else p.at[blocks].set(next(kv_it)) for p in pools)


@functools.partial(jax.jit, donate_argnums=(0,))
def _put(
    pools: tuple[Any, ...], slot: jax.Array, states: tuple[Any, ...], block: jax.Array, kv: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Restore a checkpoint: its states into `slot`, its partial block's KV into `block`."""
    states_it, kv_it, out = iter(states), iter(kv), []
    for p in pools:
        if isinstance(p, KDACache):
            conv, state = next(states_it)
            out.append(KDACache(conv=p.conv.at[slot].set(conv), state=p.state.at[slot].set(state)))
        else:
            out.append(p.at[block].set(next(kv_it)))
    return tuple(out)


class Engine:
    """Serves many sequences at once on one model. `generate` for batch use; `add_request` / `step` /
    `abort` for incremental use (the HTTP server)."""

    def __init__(self, model: HybridLM, config: EngineConfig | None = None, mesh: Any = None):
        """`mesh`: a device mesh the model's parameters are already sharded over (`sharding.placement`); the
        cache pools are then laid out on it too (KDA heads on `tensor`, slots on `data`/`expert`)."""
        self.model_config: ModelConfig = model.config
        self.mesh = mesh
        self.config = config = dataclasses.replace(config) if config else EngineConfig()
        config.validate()
        cfg = self.model_config
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
        self.kv_dtype = jnp.dtype(config.kv_dtype)
        self.block_bytes = config.block_size * cfg.latent_dim * self.kv_dtype.itemsize * cfg.num_mla_layers
        self.max_blocks_per_seq = math.ceil(self.max_model_len / config.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif config.kv_memory_bytes is not None:
            num_blocks = config.kv_memory_bytes // max(self.block_bytes, 1)
        else:
            num_blocks = config.max_slots * self.max_blocks_per_seq + 1
        if num_blocks < 2:
            raise ValueError(
                f"the KV budget gives {num_blocks} blocks of {self.block_bytes} bytes; need at least 2"
            )
        self.allocator = BlockAllocator(num_blocks)
        self.max_batched_tokens = config.max_batched_tokens or (config.prefill_chunk + config.max_slots)
        self.buckets = prefill_buckets(config.prefill_chunk)
        # Block-table widths: attention reads only as many blocks as the longest sequence in the call holds,
        # so a step costs what its context needs, not what max_model_len allows.
        self.table_buckets = table_buckets(self.max_blocks_per_seq)
        graphdef, self.params = nnx.split(model)
        self.pool_shardings = None
        if mesh is not None:
            from sharding.placement import pool_shardings

            self.pool_shardings = pool_shardings(
                cfg, mesh, slots=config.max_slots, num_blocks=num_blocks, block_size=config.block_size
            )
        self._run, self._sample = _programs(graphdef, cfg.layer_types, self.pool_shardings)
        self.pools = self._init_pools(num_blocks)
        if self.pool_shardings is not None:
            self.pools = jax.device_put(self.pools, self.pool_shardings)
        self.state_bytes_per_slot = kda_state_bytes(cfg, self.kv_dtype)["total"]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # waiting for their prefix to be read from disk
        self.requests: dict[str, Request] = {}
        self.free_slots = list(range(config.max_slots))
        self._ids = itertools.count()
        self._order = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.steps = 0
        self._failures: dict[str, RequestOutput] = {}  # requests failed outside an output-collecting call
        self.store: PrefixStore | None = None
        if config.prefix is not None and config.prefix.enabled:
            config.prefix.validate(config.block_size)
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(self.params)]
            fp = fingerprint(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str), leaves)
            layout = f"bs{config.block_size}-{self.kv_dtype.name}"
            self.store = PrefixStore(config.prefix, config.block_size, fp, self.block_bytes, layout)

    # --- pools -----------------------------------------------------------------------------------
    def _init_pools(self, num_blocks: int) -> tuple[Any, ...]:
        """Per KDA layer the slot-indexed state pool; per MLA layer the paged latent pool."""
        cfg = self.model_config
        return tuple(
            kda_zero_state(cfg, self.config.max_slots, self.kv_dtype)
            if kind == "kda"
            else jnp.zeros((num_blocks, self.config.block_size, cfg.latent_dim), self.kv_dtype)
            for kind in cfg.layer_types
        )

    def _reset_slot(self, slot: int) -> None:
        """Zero a slot's KDA state so a newly admitted request starts from the empty state."""
        self.pools = tuple(
            KDACache(conv=p.conv.at[slot].set(0), state=p.state.at[slot].set(0))
            if isinstance(p, KDACache)
            else p
            for p in self.pools
        )

    # --- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises RequestError (changing nothing) when it cannot be served."""
        params = params or SamplingParams()
        prompt = self._validate(prompt_ids, params, request_id)
        check_cache_salt(cache_salt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        req = Request(
            id=rid,
            prompt=prompt,
            params=params,
            seed=seed,
            arrival=time.perf_counter(),
            cache_salt=cache_salt,
        )
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def _validate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None
    ) -> list[int]:
        vocab = self.model_config.vocab_size
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        try:
            prompt = [int(t) for t in prompt_ids]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"prompt must be a list of integer token ids: {exc}") from None
        if any(isinstance(t, bool) or not float(t).is_integer() for t in prompt_ids):
            raise RequestError("prompt must be a list of integer token ids")
        if not prompt:
            raise RequestError("prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        try:
            params.validate(vocab)
        except SamplingError as exc:
            raise RequestError(str(exc)) from None
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the context of {self.max_model_len} tokens"
            )
        need = math.ceil(total / self.config.block_size)
        if need > self.allocator.usable:
            raise RequestError(f"the request needs {need} KV blocks but the pool has {self.allocator.usable}")
        return prompt

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its slot and blocks (e.g. the client went away)."""
        req = self.requests.get(request_id)
        if req is None or req.status == FINISHED:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def active_requests(self) -> list[Request]:
        """Every request not finished: running, waiting for a slot, or waiting for its prefix from disk."""
        return [*self.running, *self.waiting, *(r for r in self.loading if r.status != FINISHED)]

    # --- scheduling ------------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        if req.blocks:
            self.allocator.release(req.blocks)
            req.blocks = []
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)

    def _finish(self, req: Request, reason: str) -> None:
        if self.store is not None and reason != "abort" and req.slot is not None:
            self._checkpoint(req, "sequence_end", save_state=self.store.config.sequence_end_checkpoints)
        self._release(req)
        req.status, req.finish_reason, req.finish_time = FINISHED, reason, time.perf_counter()

    def _preempt(self, req: Request) -> None:
        """Give back the request's slot and blocks; it is recomputed from its tokens when readmitted."""
        self._release(req)
        req.status, req.num_computed = WAITING, 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def _ensure_blocks(self, req: Request, upto: int) -> bool:
        """Give `req` blocks for its first `upto` positions, preempting the newest others if needed.
        False when `req` itself had to be preempted."""
        need = math.ceil(upto / self.config.block_size) - len(req.blocks)
        while need > self.allocator.num_free:
            if self._evict_cached_block():
                continue
            victim = max(self.running, key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += self.allocator.allocate(need)
        return True

    def _evict_cached_block(self) -> bool:
        """Free the least recently used KV block that only the prefix store holds."""
        if self.store is None:
            return False
        block = self.store.evictable_block(self.allocator.refcount)
        if block is None:
            return False
        self.allocator.release([block])
        return True

    def _chunk(self, req: Request, budget: int) -> int:
        """Next prefill piece: bounded by the chunk and the budget, and ending on a checkpoint position."""
        n = min(req.pending, self.config.prefill_chunk, budget)
        if self.store is not None:
            interval = self.store.config.checkpoint_interval
            n = min(n, (req.num_computed // interval + 1) * interval - req.num_computed)
        return n

    def _restore(self, req: Request, found: Lookup) -> bool:
        """See `_restore_held`; the hit's checkpoint cannot be evicted meanwhile."""
        ck = found.checkpoint
        if ck is not None:
            ck.holders += 1
        try:
            return self._restore_held(req, found)
        finally:
            if ck is not None:
                ck.holders -= 1

    def _restore_held(self, req: Request, found: Lookup) -> bool:
        """Attach a hit's shared blocks and restore its checkpoint into the request's slot. A disk hit first
        loads its entry and writes the KV of the blocks the pool lacks into fresh blocks. False when `req`
        was preempted for blocks, or (still running, nothing attached) when the disk entry was unreadable."""
        t0 = time.perf_counter()
        store, bs = self.store, self.config.block_size
        self.allocator.share(found.blocks)
        req.blocks = list(found.blocks)
        ck = found.checkpoint
        if found.disk is not None:
            loaded = self._load_prefix(req, found)
            if loaded is None:
                return False
            states, tail_kv = loaded
        else:
            states = jax.tree_util.tree_map(jnp.asarray, ck.states)
            tail_kv = None if ck.tail_kv is None else jax.tree_util.tree_map(jnp.asarray, ck.tail_kv)
        tail_block = SCRATCH_BLOCK
        if found.hit % bs:
            # copy-on-write: the partial block is the request's own copy, it will write the rest of it
            if not self._ensure_blocks(req, found.hit):
                return False
            tail_block = req.blocks[-1]
        kv = (
            tail_kv
            if tail_kv is not None
            else tuple(
                jnp.zeros((bs, self.model_config.latent_dim), self.kv_dtype)
                for _ in range(self.model_config.num_mla_layers)
            )
        )
        self.pools = _put(self.pools, jnp.int32(req.slot), states, jnp.int32(tail_block), kv)
        req.num_computed = found.hit
        if ck is not None and ck.logits is not None and found.hit == len(req.tokens):
            req.stored_logits = jnp.asarray(ck.logits)[None]
        if ck is None:  # keep the disk hit in memory too: the next hit on it needs no disk read
            entry = found.disk
            store.promote(
                Checkpoint(
                    key=entry.key,
                    position=entry.position,
                    states=states,
                    tail_kv=tail_kv,
                    nbytes=self.state_bytes_per_slot + (self.block_bytes if tail_kv is not None else 0),
                    tier="device",
                    kind=entry.kind,
                )
            )
            store.enforce_budgets(lambda tree: jax.tree_util.tree_map(np.asarray, tree))
            store.disk.touch(entry)
            store.stats["disk_restores"] += 1
            store.stats["disk_restore_time_s"] += time.perf_counter() - t0
        store.stats["restores"] += 1
        store.stats["restore_time_s"] += time.perf_counter() - t0
        return True

    def _load_prefix(self, req: Request, found: Lookup) -> tuple[Any, Any] | None:
        """Read a disk entry; give `req` the blocks of its prefix: pool blocks indexed under the entry's
        chain hashes where present, fresh blocks filled from the entry for the others (then indexed).
        Returns the (states, partial block KV) as device arrays, or None (see `_restore`)."""
        store, bs = self.store, self.config.block_size
        entry = found.disk
        data = req.preloaded[1] if req.preloaded is not None and req.preloaded[0] == entry.key else None
        req.preloaded = None
        if data is None:  # unreadable (dropped from the index): the request computes from scratch
            self.allocator.release(req.blocks)
            req.blocks = []
            return None
        states, kv_full, tail = data
        num_full = entry.position // bs
        layout: list[int | None] = list(req.blocks)
        fresh = []
        for j in range(len(layout), num_full):
            block = store.blocks.get(entry.block_hashes[j])
            if block is not None and self.allocator.refcount(block) > 0:
                self.allocator.share([block])
                layout.append(block)
            else:
                layout.append(None)
                fresh.append(j)
        req.blocks = [b for b in layout if b is not None]
        if fresh:
            if not self._ensure_blocks(req, (len(req.blocks) + len(fresh)) * bs):
                return None
            new = req.blocks[len(req.blocks) - len(fresh) :]
            for j, block in zip(fresh, new, strict=True):
                layout[j] = block
            width = next(w for w in self.table_buckets if w >= len(fresh))
            ids = np.full((width,), SCRATCH_BLOCK, np.int32)
            ids[: len(fresh)] = new
            rows = np.zeros((kv_full.shape[0], width, *kv_full.shape[2:]), kv_full.dtype)
            rows[:, : len(fresh)] = kv_full[:, fresh]
            self.pools = _put_blocks(self.pools, jnp.asarray(ids), tuple(jnp.asarray(r) for r in rows))
        req.blocks = layout
        for block in store.register_blocks(req.tokens, req.blocks, num_full * bs, req.cache_salt):
            self.allocator.share([block])
        states = tuple((jnp.asarray(conv), jnp.asarray(state)) for conv, state in states)
        tail_kv = None if tail is None else tuple(jnp.asarray(t) for t in tail)
        return states, tail_kv

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests in order while slots, blocks and the token budget allow; their first
        prefill chunks. A request whose admission raises fails alone."""
        jobs = []
        while self.waiting and self.free_slots and budget > 0:
            req = self.waiting[0]
            try:
                admitted, n = self._admit_one(req, budget)
            except Exception as exc:  # noqa: BLE001 - e.g. an unreadable prefix entry: this request only
                if req in self.waiting:
                    self.waiting.remove(req)
                self._fail(req, exc)
                continue
            if not admitted:
                break
            if n is not None:
                jobs.append((req, n))
                budget -= n
        return jobs

    def _admit_one(self, req: Request, budget: int) -> tuple[bool, int | None]:
        """Admit the first waiting request: (False, None) when it does not fit now (admission stops), else
        (True, its first chunk), or (True, None) when it left the queue without a job (preempted again for
        blocks, or waiting for its prefix to be read from disk)."""
        found = self.store.lookup(req.tokens, req.cache_salt) if self.store is not None else None
        if (
            found is not None
            and found.disk is not None
            and (req.preloaded is None or req.preloaded[0] != found.disk.key)
        ):
            # the prefix is on disk: read it in the background; the request waits, the others go on
            self.waiting.popleft()
            req.loading = (found.disk, self.store.disk.load_async(found.disk))
            self.loading.append(req)
            return True, None
        hit = found.hit if found is not None else 0
        n = min(req.pending - hit, self.config.prefill_chunk, budget)
        new_blocks = math.ceil((hit + n) / self.config.block_size) - len(found.blocks if found else [])
        evictable = (
            sum(1 for b in self.store.held_blocks if self.allocator.refcount(b) == 1) if self.store else 0
        )
        if new_blocks > self.allocator.num_free + evictable:
            return False, None
        self.waiting.popleft()
        req.slot = self.free_slots.pop(0)
        req.status, req.order = RUNNING, next(self._order)
        self.running.append(req)
        self._reset_slot(req.slot)
        if found is not None and found.hit > 0 and not self._restore(req, found):
            if req.status != RUNNING:  # preempted itself for blocks: wait for the next step
                return False, None
            found = Lookup(0, found.matched, [], None)  # unreadable disk entry: compute it all
        if found is not None:
            self.store.record_hit(found)
            req.prefix_hit_tokens += found.hit
            req.recomputed_tokens += found.recomputed
        n = self._chunk(req, budget)
        if req.status != RUNNING or not self._ensure_blocks(req, req.num_computed + n):
            return True, None
        return True, n

    def _fail(self, req: Request, exc: BaseException | str, outputs: dict[str, RequestOutput] | None = None):
        """End `req` with finish_reason "error" (its slot and blocks freed) because serving it raised; the
        engine goes on with everyone else. The output reaches its client with the next step's outputs."""
        if self._pools_lost():
            raise RuntimeError("the cache pools were lost in a failed program call") from (
                exc if isinstance(exc, BaseException) else None
            )
        cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.error(
            "request %s failed: %s", req.id, cause, exc_info=exc if isinstance(exc, BaseException) else None
        )
        if req.status != FINISHED:
            if req in self.waiting:
                self.waiting.remove(req)
            self._release(req)
            req.status, req.finish_reason, req.finish_time = FINISHED, "error", time.perf_counter()
            req.error = cause
        out = RequestOutput(req.id, [], [], True, "error", req.prefix_hit_tokens, cause)
        (self._failures if outputs is None else outputs)[req.id] = out

    def _poll_loads(self) -> None:
        """Requests whose prefix finished loading from disk go back to the front of the queue (in arrival
        order) with what was read; with nothing else to do, wait a moment for one."""
        if not self.loading:
            return
        if not self.running and not self.waiting:
            cf.wait([r.loading[1] for r in self.loading], timeout=0.05, return_when=cf.FIRST_COMPLETED)
        done = [r for r in self.loading if r.loading[1].done()]
        for req in sorted(done, key=lambda r: r.arrival, reverse=True):
            self.loading.remove(req)
            (entry, fut), req.loading = req.loading, None
            data = self.store.disk.finish_load(entry, fut)
            if req.status == FINISHED:  # aborted while it waited
                continue
            req.preloaded = (entry.key, data)
            self.waiting.appendleft(req)

    def _pools_lost(self) -> bool:
        """Whether a failed program consumed (donated) the pools without returning new ones."""
        return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.pools))

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a step that raised with no single request to blame: end every running request with an
        error (its cached state may be half written), rebuild the pools if the failed program consumed
        them (the prefix store then forgets its KV blocks, its checkpoints are copies and stay), and keep
        the waiting requests. Returns the outputs that tell their clients."""
        outputs: dict[str, RequestOutput] = {}
        for req in list(self.running):
            self._release(req)
            req.status, req.finish_reason, req.finish_time = FINISHED, "error", time.perf_counter()
            req.error = f"the engine step failed: {reason}"
            outputs[req.id] = RequestOutput(req.id, [], [], True, "error", req.prefix_hit_tokens, req.error)
        if self._pools_lost():
            log.warning("rebuilding the cache pools after a failed program call")
            if self.store is not None:
                self.allocator.release(self.store.forget_blocks())
            self.pools = self._init_pools(self.allocator.num_blocks)
            if self.pool_shardings is not None:
                self.pools = jax.device_put(self.pools, self.pool_shardings)
        return list(outputs.values())

    def _checkpoint(
        self, req: Request, kind: str, save_state: bool = True, logits: jax.Array | None = None
    ) -> None:
        """Index the request's full blocks and (with `save_state`) keep the slot's KDA states at
        req.num_computed, with a copy of the partial block when that position is not block-aligned."""
        store, pos = self.store, req.num_computed
        if pos == 0:
            return
        tokens = req.tokens
        for block in store.register_blocks(tokens, req.blocks, pos, req.cache_salt):
            self.allocator.share([block])
        store.record_tail(tokens, pos, req.cache_salt)
        key = store.key_for(tokens, pos, req.cache_salt)
        if not save_state:
            return
        if key in store.checkpoints:
            store.checkpoints.move_to_end(key)
            if logits is not None and store.checkpoints[key].logits is None:
                store.checkpoints[key].logits = logits
            return
        t0 = time.perf_counter()
        partial = pos % self.config.block_size != 0
        block = req.blocks[pos // self.config.block_size] if partial else SCRATCH_BLOCK
        states, kv = _take(self.pools, jnp.int32(req.slot), jnp.int32(block))
        nbytes = self.state_bytes_per_slot + (self.block_bytes if partial else 0)
        store.add_checkpoint(
            Checkpoint(
                key=key,
                position=pos,
                states=states,
                tail_kv=kv if partial else None,
                nbytes=nbytes,
                tier="device",
                kind=kind,
                logits=logits,
            )
        )
        store.enforce_budgets(lambda tree: jax.tree_util.tree_map(np.asarray, tree))
        num_full = pos // self.config.block_size
        meta = store.plan_disk_save(tokens, pos, req.cache_salt, kind, nbytes + num_full * self.block_bytes)
        if meta is not None:  # write-through: the disk entry holds the KV of the whole prefix
            kv_full, held = None, nbytes  # held: device bytes the queued save keeps alive
            if num_full:
                width = next(w for w in self.table_buckets if w >= num_full)
                ids = np.full((width,), SCRATCH_BLOCK, np.int32)
                ids[:num_full] = req.blocks[:num_full]
                kv_full = _gather(self.pools, jnp.asarray(ids))
                held += width * self.block_bytes
            store.submit_disk_save(meta, (states, kv_full, num_full, kv if partial else None), held)
        store.stats["save_time_s"] += time.perf_counter() - t0

    def _after_compute(self, req: Request, logits: jax.Array | None = None) -> None:
        """Checkpoints due now that req.num_computed advanced: interval multiples and the prompt end. At the
        prompt end the next-token `logits` are kept too, so an identical prompt needs no prefill at all."""
        if self.store is None or req.status != RUNNING:
            return
        cfg = self.store.config
        at_prompt_end = cfg.prompt_end_checkpoints and req.num_computed == len(req.prompt)
        keep = logits if at_prompt_end else None
        if req.num_computed % cfg.checkpoint_interval == 0:
            self._checkpoint(req, "interval", logits=keep)
        elif at_prompt_end:
            self._checkpoint(req, "prompt_end", logits=keep)

    def _table_width(self, reqs: Sequence[Request]) -> int:
        need = max(len(r.blocks) for r in reqs)
        return next(w for w in self.table_buckets if w >= need)

    def _block_table(self, req: Request, width: int) -> np.ndarray:
        row = np.full((width,), SCRATCH_BLOCK, np.int32)
        row[: len(req.blocks)] = req.blocks
        return row

    def step(self) -> list[RequestOutput]:
        """One scheduling round: a decode step for every request that has a token to extend, plus prefill
        chunks (continuing ones first, then newly admitted) under the token budget."""
        self.steps += 1
        if self.store is not None:
            self.store.poll_disk()  # disk saves that finished become visible to lookups now
            self._poll_loads()
        outputs: dict[str, RequestOutput] = {}
        budget = self.max_batched_tokens
        for req in sorted(self.running, key=lambda r: r.order):
            if req.status == RUNNING and req.pending == 1:
                self._ensure_blocks(req, req.num_computed + 1)
        budget -= sum(1 for r in self.running if r.pending == 1)  # reserved for the decode rows
        planned: list[tuple[Request, int, int]] = []  # (request, tokens, its admission order when planned)
        for req in sorted(self.running, key=lambda r: r.order):
            if budget <= 0:
                break
            if req.status == RUNNING and req.pending > 1:
                n = self._chunk(req, budget)
                if self._ensure_blocks(req, req.num_computed + n):
                    planned.append((req, n, req.order))
                    budget -= n
        planned += [(r, n, r.order) for r, n in self._admit(budget)]
        # The plan is fixed only now: a later allocation may have preempted a request planned earlier, and
        # admission may have readmitted it (with a new order) in this same step. Such a request keeps only
        # its newest job; the decode rows are the running requests with one token to extend and no prefill.
        prefill = [(r, n) for r, n, order in planned if r.status == RUNNING and r.order == order]
        chunked = {id(r) for r, _ in prefill}
        decode = [r for r in self.running if r.pending == 1 and id(r) not in chunked]
        if decode:
            self._decode(decode, outputs)
        for req, n in prefill:
            if req.status != RUNNING:  # a decode row's checkpoint failed it, or preempted it
                continue
            try:
                self._prefill(req, n, outputs)
            except Exception as exc:  # noqa: BLE001 - this request only (the step fails if the pools went)
                self._fail(req, exc, outputs)
        outputs.update(self._failures)
        self._failures = {}
        return list(outputs.values())

    # --- program calls ---------------------------------------------------------------------------
    def run_program(
        self,
        tokens: np.ndarray,
        slot_ids: np.ndarray,
        tables: np.ndarray,
        start: np.ndarray,
        valid: np.ndarray,
    ) -> jax.Array:
        """Run `tokens` [B, T] for slots `slot_ids` (block tables [B, W], positions from `start`, `valid` real
        tokens per row); updates the pools, returns the logits after each row's last real token."""
        logits, self.pools = self._run(
            self.params,
            self.pools,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(slot_ids, jnp.int32),
            jnp.asarray(tables, jnp.int32),
            jnp.asarray(start, jnp.int32),
            jnp.asarray(valid, jnp.int32),
        )
        return logits

    def _decode(self, reqs: list[Request], outputs: dict[str, RequestOutput]) -> None:
        slots = self.config.max_slots
        tokens = np.zeros((slots, 1), np.int32)
        width = self._table_width(reqs)
        tables = np.full((slots, width), SCRATCH_BLOCK, np.int32)
        start = np.zeros((slots,), np.int32)
        valid = np.zeros((slots,), np.int32)
        by_slot: list[Request | None] = [None] * slots
        for req in reqs:
            s = req.slot
            tokens[s, 0] = req.tokens[req.num_computed]
            tables[s] = self._block_table(req, width)
            start[s], valid[s], by_slot[s] = req.num_computed, 1, req
        t0 = time.perf_counter()
        logits = self.run_program(tokens, np.arange(slots, dtype=np.int32), tables, start, valid)
        ids, logps = self._sample_rows(logits, by_slot)
        dt = time.perf_counter() - t0
        for req in reqs:
            req.num_computed += 1
            req.decode_time += dt
            try:
                self._after_compute(req)
                self._append(req, int(ids[req.slot]), float(logps[req.slot]), outputs)
            except Exception as exc:  # noqa: BLE001 - e.g. a checkpoint that could not be kept
                self._fail(req, exc, outputs)

    def _prefill(self, req: Request, n: int, outputs: dict[str, RequestOutput]) -> None:
        if n == 0 and req.stored_logits is not None:  # full prefix hit: sample from the kept logits
            logits, req.stored_logits = req.stored_logits, None
            ids, logps = self._sample_rows(logits, [req])
            self._append(req, int(ids[0]), float(logps[0]), outputs)
            return
        bucket = next(b for b in self.buckets if b >= n)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = req.tokens[req.num_computed : req.num_computed + n]
        t0 = time.perf_counter()
        table = self._block_table(req, self._table_width([req]))[None]
        logits = self.run_program(
            tokens, np.asarray([req.slot]), table, np.asarray([req.num_computed]), np.asarray([n])
        )
        req.num_computed += n
        req.prefill_tokens += n
        self._after_compute(req, logits[0])
        if req.pending == 0:
            ids, logps = self._sample_rows(logits, [req])
            req.prefill_time += time.perf_counter() - t0
            self._append(req, int(ids[0]), float(logps[0]), outputs)
        else:
            jax.block_until_ready(logits)
            req.prefill_time += time.perf_counter() - t0

    def _sample_rows(self, logits: jax.Array, rows: list[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        params = [None if r is None else r.params for r in rows]
        seeds = [0 if r is None else r.seed for r in rows]
        steps = [0 if r is None else len(r.generated) for r in rows]
        temperature, top_k, top_p, keys = batch_arrays(params, seeds, steps)
        ids, logps = self._sample(logits, temperature, top_k, top_p, keys)
        return np.asarray(ids), np.asarray(logps)

    def _append(self, req: Request, token: int, logprob: float, outputs: dict[str, RequestOutput]) -> None:
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
        req.generated.append(token)
        req.logprobs.append(logprob)
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.model_config.eos_token_id):
            reason = "stop"
        elif len(req.generated) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
            reason = "length"
        if reason:
            self._finish(req, reason)
        out = outputs.setdefault(req.id, RequestOutput(req.id, [], [], False, None, req.prefix_hit_tokens))
        out.new_token_ids.append(token)
        out.new_logprobs.append(logprob)
        out.finished, out.finish_reason = req.status == FINISHED, req.finish_reason

    # --- batch API ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Serve every prompt to completion, results in prompt order; invalid requests raise first."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise RequestError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        for prompt, params in zip(prompts, sampling, strict=True):
            self._validate(prompt, params, None)
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
        while any(self.requests[i].status != FINISHED for i in ids):
            self.step()
        return [self.result(i) for i in ids]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (a long-running server calls this once it has delivered it)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == FINISHED:
            del self.requests[request_id]

    def result(self, request_id: str) -> GenerateResult:
        req = self.requests[request_id]
        return GenerateResult(
            request_id,
            list(req.generated),
            list(req.logprobs) if req.params.logprobs else None,
            req.finish_reason or "",
            req.stats(),
        )

    def flush(self) -> None:
        """Wait for every pending disk save of the prefix store and make it visible (graceful shutdown)."""
        if self.store is not None:
            self.store.poll_disk(wait=True)

    # --- memory account ----------------------------------------------------------------------------
    def ledger(self) -> dict[str, Any]:
        """Every byte the engine and its prefix store hold, and what reuse saved or cost."""
        live_blocks = {b for r in self.running for b in r.blocks}
        out: dict[str, Any] = {
            "live_kv_bytes": len(live_blocks) * self.block_bytes,
            "live_state_bytes": len(self.running) * self.state_bytes_per_slot,
            "cached_kv_blocks": 0,
            "cached_kv_bytes": 0,
            "checkpoint_bytes": {"device": 0, "host": 0, "disk": 0},
            "checkpoints": {"device": 0, "host": 0, "disk": 0},
            "prefix_cache": self.store is not None,
        }
        if self.store is None:
            return out
        cached = [b for b in self.store.held_blocks if b not in live_blocks]
        out["cached_kv_blocks"] = len(cached)
        out["cached_kv_bytes"] = len(cached) * self.block_bytes
        for ck in self.store.checkpoints.values():
            out["checkpoint_bytes"][ck.tier] += ck.nbytes
            out["checkpoints"][ck.tier] += 1
        out["checkpoint_interval"] = self.store.config.checkpoint_interval
        out.update(self.store.stats)
        disk = self.store.disk
        if disk is not None:  # disk: bytes of the committed entries (states + KV of their prefixes + files)
            out["checkpoint_bytes"]["disk"] = disk.bytes
            out["checkpoints"]["disk"] = len(disk.entries)
            out["disk_pending"] = len(disk.pending)
            out["disk_loading"] = len(self.loading)
            out["disk_pending_bytes"] = disk.pending_bytes
            out["disk_ignored"] = len(disk.ignored)
            out["store_dir"] = str(disk.dir)
        return out

    def memory(self) -> dict[str, Any]:
        """Bytes held by the engine: KV blocks (used/free), live KDA states, and per running request."""
        alloc = self.allocator
        live = len(self.running)
        return {
            "block_size": self.config.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": alloc.usable,
            "used_blocks": alloc.num_used,
            "free_blocks": alloc.num_free,
            "kv_bytes_total": alloc.usable * self.block_bytes,
            "kv_bytes_used": alloc.num_used * self.block_bytes,
            "kv_bytes_free": alloc.num_free * self.block_bytes,
            "slots": self.config.max_slots,
            "state_bytes_per_slot": self.state_bytes_per_slot,
            "state_pool_bytes": self.config.max_slots * self.state_bytes_per_slot,
            "live_states": live,
            "state_bytes_live": live * self.state_bytes_per_slot,
            "requests": {
                r.id: {
                    "blocks": len(r.blocks),
                    "kv_bytes": len(r.blocks) * self.block_bytes,
                    "state_bytes": self.state_bytes_per_slot,
                    "tokens": r.num_computed,
                }
                for r in self.running
            },
        }

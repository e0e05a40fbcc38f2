"""Prefix store: reuse a shared prompt prefix without recomputing it.

MLA layers: full KV blocks are indexed by a chained hash of their tokens and shared by reference count.
KDA layers: a state is valid only at the exact position it was taken, so the store keeps state
checkpoints at every multiple of `checkpoint_interval` tokens and (switchable) at the end of every
prompt and every finished sequence. A checkpoint that does not end on a block boundary keeps a copy
of its partial last block's KV, so short and unaligned prompts hit too. A hit is the longest prefix
whose KV blocks are present and that ends at a checkpoint.

Tiers: checkpoint states live on the device until the device budget is exceeded, then are demoted to
host memory (numpy), then dropped (LRU in each tier). Cached KV blocks live in the engine's pool and
are evicted (LRU, only those no running request holds) when the pool runs out. With `store_dir` set,
every checkpoint is also written through to disk (`serve.prefix.disk`: Orbax, in the background) with
the KV of its whole prefix, so it still hits after it left memory, its blocks left the pool, or the
engine restarted; the disk tier has its own budget (LRU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from serve.prefix.disk import DiskEntry, DiskTier, namespace


@dataclasses.dataclass
class PrefixStoreConfig:
    enabled: bool = True
    checkpoint_interval: int = 32768
    prompt_end_checkpoints: bool = True
    sequence_end_checkpoints: bool = True
    device_bytes: int = 1 << 30
    host_bytes: int = 4 << 30
    store_dir: str | None = None  # disk tier (write-through) when set
    disk_bytes: int = 16 << 30
    disk_max_pending: int = 64  # saves queued at most; a checkpoint beyond that is not written
    disk_max_pending_bytes: int = 1 << 30  # and the device bytes those queued saves may hold
    max_tails: int = 16384  # partial blocks remembered (for how far a prompt matches), least recent dropped

    def validate(self, block_size: int) -> None:
        if self.checkpoint_interval < 1 or self.checkpoint_interval % block_size:
            raise ValueError(
                f"checkpoint_interval ({self.checkpoint_interval}) must be a positive multiple of "
                f"the block size ({block_size})"
            )
        for name in ("device_bytes", "host_bytes", "disk_bytes", "disk_max_pending_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"prefix store setting '{name}' must be >= 0")
        if self.disk_max_pending < 1:
            raise ValueError("prefix store setting 'disk_max_pending' must be >= 1")
        if self.max_tails < 0:
            raise ValueError("prefix store setting 'max_tails' must be >= 0")
        if self.store_dir is not None and Path(self.store_dir).exists() and not Path(self.store_dir).is_dir():
            raise ValueError(f"prefix store directory '{self.store_dir}' is not a directory")


@dataclasses.dataclass
class Checkpoint:
    """KDA states after `position` tokens (+ the partial last block's KV when position % block_size)."""

    key: bytes
    position: int
    states: Any  # per KDA layer (conv, state): device arrays, or numpy on the host tier
    tail_kv: Any  # per MLA layer [block_size, latent] (first position % block_size rows valid), or None
    nbytes: int
    tier: str  # "device" | "host"
    kind: str  # "interval" | "prompt_end" | "sequence_end"
    holders: int = 0  # running requests restoring from it right now (never evicted while > 0)
    logits: Any = (
        None  # [vocab] next-token logits at `position` (prompt ends): an identical prompt hits fully
    )


@dataclasses.dataclass
class Lookup:
    """A prompt match: reuse `hit` tokens (blocks + checkpoint), recompute the rest of `matched`. A disk
    hit has `disk` set instead of `checkpoint`; `blocks` are then the leading blocks already in the pool."""

    hit: int
    matched: int
    blocks: list[int]
    checkpoint: Checkpoint | None
    disk: DiskEntry | None = None

    @property
    def recomputed(self) -> int:
        return max(0, self.matched - self.hit)


class TailIndex:
    """The partial blocks (token tuples) seen after each chain hash, so a lookup knows how far a prompt
    matches beyond its full blocks (the recompute a hit leaves). At most `limit` entries: the least
    recently seen go first, and a block's entries go with the block (`drop`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._order: OrderedDict[tuple[bytes, tuple[int, ...]], None] = OrderedDict()
        self._by_hash: dict[bytes, set[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._order)

    def add(self, chain_hash: bytes, tail: tuple[int, ...]) -> None:
        key = (chain_hash, tail)
        if key in self._order:
            self._order.move_to_end(key)
            return
        self._order[key] = None
        self._by_hash.setdefault(chain_hash, set()).add(tail)
        while len(self._order) > self.limit:
            (h, t), _ = self._order.popitem(last=False)
            self._discard(h, t)

    def get(self, chain_hash: bytes) -> tuple[tuple[int, ...], ...]:
        return tuple(self._by_hash.get(chain_hash, ()))

    def drop(self, chain_hash: bytes) -> None:
        """Forget every tail after `chain_hash` (its block left the store)."""
        for tail in self._by_hash.pop(chain_hash, ()):
            del self._order[(chain_hash, tail)]

    def clear(self) -> None:
        self._order.clear()
        self._by_hash.clear()

    def _discard(self, chain_hash: bytes, tail: tuple[int, ...]) -> None:
        tails = self._by_hash[chain_hash]
        tails.discard(tail)
        if not tails:
            del self._by_hash[chain_hash]


def fingerprint(config_json: str, leaves: list[np.ndarray]) -> bytes:
    """Model identity: the config and a sample of every weight's bytes (first and last 4 KiB)."""
    h = hashlib.sha256(config_json.encode())
    for leaf in leaves:
        raw = np.ascontiguousarray(leaf).view(np.uint8).reshape(-1)
        h.update(
            str(leaf.shape).encode() + str(leaf.dtype).encode() + raw[:4096].tobytes() + raw[-4096:].tobytes()
        )
    return h.digest()


class PrefixStore:
    def __init__(
        self,
        config: PrefixStoreConfig,
        block_size: int,
        model_fingerprint: bytes,
        block_bytes: int,
        layout: str = "",
    ):
        self.config = config
        self.block_size = block_size
        self.fingerprint = model_fingerprint
        self.block_bytes = block_bytes
        self.blocks: OrderedDict[bytes, int] = (
            OrderedDict()
        )  # full-block chain hash -> pool block (LRU order)
        self.block_hash_of: dict[int, bytes] = {}
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # LRU order
        self.tails = TailIndex(config.max_tails)  # chain hash -> partial tails seen after it
        self.stats = {
            "lookups": 0,
            "hits": 0,
            "hit_tokens": 0,
            "recomputed_tokens": 0,
            "saves": 0,
            "save_time_s": 0.0,
            "restores": 0,
            "restore_time_s": 0.0,
            "demotions": 0,
            "dropped_checkpoints": 0,
            "evicted_blocks": 0,
            "disk_saves": 0,
            "disk_save_time_s": 0.0,
            "disk_restores": 0,
            "disk_restore_time_s": 0.0,
            "disk_dropped": 0,
            "disk_skipped": 0,
            "disk_save_errors": 0,
            "disk_restore_errors": 0,
        }
        self.disk: DiskTier | None = None
        if config.store_dir is not None:
            # entries are only valid for this model and this cache layout (block size, KV dtype)
            self.disk = DiskTier(
                config.store_dir,
                namespace(model_fingerprint, layout),
                model_fingerprint,
                block_size,
                config.disk_bytes,
                config.disk_max_pending,
                config.disk_max_pending_bytes,
                self.stats,
            )
            for entry in self.disk.entries.values():
                self._note_disk_tail(entry)

    # --- hashing ---------------------------------------------------------------------------------
    def root(self, salt: str | None) -> bytes:
        return hashlib.sha256(self.fingerprint + b"salt:" + (salt or "").encode()).digest()

    def chain(self, tokens: list[int], salt: str | None) -> list[bytes]:
        """h_0 = root; h_i = sha256(h_{i-1} || fingerprint || salt || tokens of block i), full blocks only."""
        out = [self.root(salt)]
        salt_b = (salt or "").encode()
        for i in range(len(tokens) // self.block_size):
            block = np.asarray(tokens[i * self.block_size : (i + 1) * self.block_size], np.int64).tobytes()
            out.append(hashlib.sha256(out[-1] + self.fingerprint + salt_b + block).digest())
        return out

    @staticmethod
    def checkpoint_key(chain_hash: bytes, tail: tuple[int, ...]) -> bytes:
        return hashlib.sha256(chain_hash + b"tail:" + np.asarray(tail, np.int64).tobytes()).digest()

    # --- lookup ----------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], salt: str | None) -> Lookup:
        """Longest reusable prefix of `tokens`: all of them when a checkpoint at their end kept its next-token
        logits, else at most len - 1 (one token is left to produce logits)."""
        self.stats["lookups"] += 1
        limit = len(tokens) - 1
        chain = self.chain(tokens, salt)
        disk = self.disk
        nb = 0  # full blocks in the pool
        while nb + 1 < len(chain) and chain[nb + 1] in self.blocks:
            nb += 1
        reach = nb  # full blocks in the pool or inside a disk entry
        if disk is not None:
            while reach + 1 < len(chain) and (
                chain[reach + 1] in self.blocks or chain[reach + 1] in disk.block_refs
            ):
                reach += 1
        bs = self.block_size
        # how far the match goes: full blocks, then the longest partial tail seen after them
        matched = reach * bs
        for tail in self.tails.get(chain[reach]):
            r = len(tail)
            if tuple(tokens[reach * bs : reach * bs + r]) == tail:
                matched = max(matched, reach * bs + r)
        matched = min(matched, limit)
        best: tuple[int, Checkpoint | DiskEntry] | None = None
        end_blocks = len(tokens) // bs
        if (
            end_blocks <= nb
        ):  # an identical earlier prompt whose checkpoint kept its logits: nothing to compute
            ck = self.checkpoints.get(
                self.checkpoint_key(chain[end_blocks], tuple(tokens[end_blocks * bs :]))
            )
            if ck is not None and ck.logits is not None:
                best = (len(tokens), ck)
                matched = len(tokens)
        for i in range(reach, -1, -1):
            if best is not None:
                break
            base = i * bs
            if base > limit:
                continue
            for r in range(min(bs - 1, limit - base), -1, -1):
                key = self.checkpoint_key(chain[i], tuple(tokens[base : base + r]))
                # a checkpoint in memory needs its blocks in the pool; a disk entry carries its own
                ck = self.checkpoints.get(key) if i <= nb else None
                if ck is None and disk is not None:
                    ck = disk.entries.get(key)
                if ck is not None:
                    best = (base + r, ck)
                    break
            if best is not None:
                break
        if best is None:
            return Lookup(0, matched, [], None)
        pos, ck = best
        in_pool = min(nb, pos // bs)
        blocks = [self.blocks[chain[j]] for j in range(1, in_pool + 1)]
        for j in range(in_pool, 0, -1):  # deepest first, so LRU eviction trims chains from their ends
            self.blocks.move_to_end(chain[j])
        if isinstance(ck, DiskEntry):
            return Lookup(pos, max(matched, pos), blocks, None, disk=ck)
        self.checkpoints.move_to_end(ck.key)
        return Lookup(pos, max(matched, pos), blocks, ck)

    def record_hit(self, found: Lookup) -> None:
        if found.hit > 0:
            self.stats["hits"] += 1
        self.stats["hit_tokens"] += found.hit
        self.stats["recomputed_tokens"] += found.recomputed

    # --- inserting -------------------------------------------------------------------------------
    def register_blocks(self, tokens: list[int], blocks: list[int], upto: int, salt: str | None) -> list[int]:
        """Index the full blocks covering tokens[:upto]; returns the pool blocks the store newly holds."""
        chain = self.chain(tokens[:upto], salt)
        newly = []
        for i in range(len(chain) - 1, 0, -1):  # deepest first: LRU eviction trims chains from their ends
            h = chain[i]
            if h in self.blocks:
                self.blocks.move_to_end(h)
                continue
            block = blocks[i - 1]
            if block in self.block_hash_of:  # already indexed under its own hash
                continue
            self.blocks[h] = block
            self.block_hash_of[block] = h
            newly.append(block)
        return newly

    def record_tail(self, tokens: list[int], upto: int, salt: str | None) -> None:
        """Remember the partial block after the last full block of tokens[:upto] (tokens only)."""
        nb = upto // self.block_size
        tail = tuple(tokens[nb * self.block_size : upto])
        if tail:
            chain = self.chain(tokens[: nb * self.block_size], salt)
            self.tails.add(chain[-1], tail)

    def key_for(self, tokens: list[int], position: int, salt: str | None) -> bytes:
        nb = position // self.block_size
        chain = self.chain(tokens[: nb * self.block_size], salt)
        return self.checkpoint_key(chain[-1], tuple(tokens[nb * self.block_size : position]))

    def add_checkpoint(self, ck: Checkpoint) -> None:
        old = self.checkpoints.pop(ck.key, None)
        if old is not None and old.holders:
            self.checkpoints[ck.key] = old  # keep the one in use
            return
        self.checkpoints[ck.key] = ck
        self.stats["saves"] += 1

    def promote(self, ck: Checkpoint) -> None:
        """Bring a checkpoint restored from disk into memory (not counted as a save)."""
        old = self.checkpoints.get(ck.key)
        if old is not None and old.holders:
            return
        self.checkpoints[ck.key] = ck
        self.checkpoints.move_to_end(ck.key)

    # --- disk tier -------------------------------------------------------------------------------
    def _note_disk_tail(self, entry: DiskEntry) -> None:
        if entry.tail:
            self.tails.add(entry.base, entry.tail)

    def plan_disk_save(
        self, tokens: list[int], position: int, salt: str | None, kind: str, nbytes: int
    ) -> dict[str, Any] | None:
        """Metadata of the disk entry for the checkpoint at `position` of `tokens`, or None when it is not
        to be written (no disk tier, already on disk or on its way, over the budget, queue full)."""
        if self.disk is None:
            return None
        nb = position // self.block_size
        chain = self.chain(tokens[: nb * self.block_size], salt)
        tail = [int(t) for t in tokens[nb * self.block_size : position]]
        key = self.checkpoint_key(chain[-1], tuple(tail))
        if not self.disk.wants(key, nbytes):
            return None
        return {
            "key": key.hex(),
            "fingerprint": self.fingerprint.hex(),
            "block_size": self.block_size,
            "position": position,
            "kind": kind,
            "base": chain[-1].hex(),
            "block_hashes": [h.hex() for h in chain[1:]],
            "tail": tail,
            "created": time.time(),
        }

    def submit_disk_save(self, meta: dict[str, Any], payload: Any, device_bytes: int) -> None:
        """Write a planned entry in the background. `payload` = (states, kv of the full blocks, number of
        full blocks, partial block's KV or None), device arrays the caller no longer changes."""
        self.disk.submit(meta, payload, device_bytes)

    def poll_disk(self, wait: bool = False) -> None:
        """Make finished disk saves visible to lookups (waiting for all of them with `wait`)."""
        if self.disk is None:
            return
        for entry in self.disk.poll(wait=wait):
            self._note_disk_tail(entry)

    def tier_bytes(self, tier: str) -> int:
        return sum(c.nbytes for c in self.checkpoints.values() if c.tier == tier)

    def enforce_budgets(self, to_host: Any) -> None:
        """Demote LRU device checkpoints to the host while over the device budget, then drop LRU host ones."""
        for tier, budget in (("device", self.config.device_bytes), ("host", self.config.host_bytes)):
            used = self.tier_bytes(tier)
            for ck in list(self.checkpoints.values()):
                if used <= budget:
                    break
                if ck.tier != tier or ck.holders:
                    continue
                used -= ck.nbytes
                if tier == "device" and ck.nbytes <= self.config.host_bytes:
                    ck.states, ck.tail_kv = to_host(ck.states), to_host(ck.tail_kv)
                    ck.logits = None if ck.logits is None else to_host(ck.logits)
                    ck.tier = "host"
                    self.stats["demotions"] += 1
                else:
                    del self.checkpoints[ck.key]
                    self.stats["dropped_checkpoints"] += 1

    def evictable_block(self, refcount: Any) -> int | None:
        """The least recently used cached block that only the store holds, removed from the index."""
        for h, block in self.blocks.items():
            if refcount(block) == 1:
                del self.blocks[h]
                del self.block_hash_of[block]
                if self.disk is None or h not in self.disk.block_refs:  # a disk entry may still reach it
                    self.tails.drop(h)
                self.stats["evicted_blocks"] += 1
                return block
        return None

    def forget_blocks(self) -> list[int]:
        """Drop the whole KV block index (the pool was rebuilt); returns the blocks the store held."""
        held = list(self.blocks.values())
        self.blocks.clear()
        self.block_hash_of.clear()
        self.tails.clear()
        return held

    @property
    def held_blocks(self) -> list[int]:
        return list(self.blocks.values())

    def now(self) -> float:
        return time.perf_counter()

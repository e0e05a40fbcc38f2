"""What the prefix store indexes: chained block hashes, the full KV blocks it keeps in the engine's pool
(one allocator reference each), and the partial blocks it has seen (for how far a prompt matches)."""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from serve.prefix.events import AllBlocksCleared, BlockRemoved, EventLog, blocks_stored
from serve.prefix.junctions import common_prefix


class ChainHasher:
    """h_0 = sha256(fingerprint || salt); h_i = sha256(h_{i-1} || fingerprint || salt || tokens of block i).
    A checkpoint is keyed by the chain hash of its last full block and the tokens after it."""

    def __init__(self, fingerprint: bytes, block_size: int):
        self.fingerprint, self.block_size = fingerprint, block_size

    def root(self, salt: str | None) -> bytes:
        return hashlib.sha256(self.fingerprint + b"salt:" + (salt or "").encode()).digest()

    def chain(self, tokens: Sequence[int], salt: str | None) -> list[bytes]:
        """[h_0, h_1, ...]: the root, then one hash per full block of `tokens`."""
        return self.extend([], tokens, salt, len(tokens) // self.block_size)

    def extend(self, chain: list[bytes], tokens: Sequence[int], salt: str | None, blocks: int) -> list[bytes]:
        """`chain` (the chain of a prefix of `tokens`, or []) extended in place to at least `blocks` full
        blocks, hashing only the blocks it lacks; returns it."""
        if not chain:
            chain.append(self.root(salt))
        salt_b = (salt or "").encode()
        bs = self.block_size
        for i in range(len(chain) - 1, blocks):
            block = np.asarray(tokens[i * bs : (i + 1) * bs], np.int64).tobytes()
            chain.append(hashlib.sha256(chain[-1] + self.fingerprint + salt_b + block).digest())
        return chain

    @staticmethod
    def checkpoint_key(chain_hash: bytes, tail: Sequence[int]) -> bytes:
        return hashlib.sha256(chain_hash + b"tail:" + np.asarray(tail, np.int64).tobytes()).digest()


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

    def keys(self) -> list[tuple[bytes, tuple[int, ...]]]:
        return list(self._order)

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


class BlockIndex:
    """Full KV blocks by chain hash, least recently used first. The store holds one allocator reference on
    each indexed block, so a cached block outlives the request that computed it; a block only the store
    holds can be evicted when the pool runs out.

    Blocks a held state checkpoint needs (`hold`: every full block below it; a checkpoint resumes nothing
    without them) are kept apart from the rest: `evict_one` gives up a block nothing resumable depends on
    first, and one a checkpoint needs only when there is no other (the joint eviction of `PrefixStore`,
    which gives up a checkpoint first; without it nothing is ever held and the order is plain LRU)."""

    def __init__(self, allocator: Any, block_size: int = 0, log: EventLog | None = None):
        """`log`: where BlockStored / BlockRemoved / AllBlocksCleared go (`serve.prefix.events`)."""
        self.allocator, self.block_size, self.log = allocator, block_size, log
        self._blocks: dict[bytes, int] = {}  # chain hash -> pool block
        self._hash_of: dict[int, bytes] = {}
        # LRU order of the blocks no checkpoint needs (False) and of those some checkpoint needs (True)
        self._lru: dict[bool, OrderedDict[bytes, None]] = {False: OrderedDict(), True: OrderedDict()}
        self._needed: Counter[bytes] = Counter()  # chain hash -> held checkpoints over it

    def __contains__(self, chain_hash: bytes) -> bool:
        return chain_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, chain_hash: bytes) -> int | None:
        """The pool block indexed under `chain_hash` while it is still allocated."""
        block = self._blocks.get(chain_hash)
        return block if block is not None and self.allocator.refcount(block) > 0 else None

    def hashes(self) -> list[bytes]:
        return list(self._blocks)

    def held(self) -> list[int]:
        return list(self._blocks.values())

    def _queue(self, chain_hash: bytes) -> OrderedDict[bytes, None]:
        return self._lru[chain_hash in self._needed]

    def touch(self, chain: Sequence[bytes]) -> None:
        """Mark blocks used, deepest first (so LRU eviction trims chains from their ends)."""
        for h in reversed(chain):
            if h in self._blocks:
                self._queue(h).move_to_end(h)

    def register(
        self, chain: Sequence[bytes], blocks: Sequence[int], first: int = 1, tokens: Sequence[int] = ()
    ) -> None:
        """Index blocks[j] under chain[first + j] (deepest first; `chain`: a sequence's chain hashes, root
        first, and `tokens` its tokens), taking a reference on each newly indexed one."""
        new = []
        for j in reversed(range(len(blocks))):
            h, block = chain[first + j], blocks[j]
            if h in self._blocks:
                self._queue(h).move_to_end(h)
            elif block not in self._hash_of:  # a block already indexed under its own hash stays there
                self._blocks[h] = block
                self._hash_of[block] = h
                self._queue(h)[h] = None
                self.allocator.share([block])
                new.append(first + j)
        if self.log is not None and new:
            for event in blocks_stored(chain, new, tokens, self.block_size):
                self.log.add(event)

    def hold(self, chain: Sequence[bytes]) -> None:
        """A checkpoint needing the blocks of `chain` is held."""
        for h in chain:
            self._needed[h] += 1
            if self._needed[h] == 1 and h in self._blocks:
                del self._lru[False][h]
                self._lru[True][h] = None

    def unhold(self, chain: Sequence[bytes]) -> None:
        """A checkpoint `hold` counted is gone: blocks nothing needs now go first (deepest first)."""
        for h in chain:
            self._needed[h] -= 1
            if self._needed[h] <= 0:
                del self._needed[h]
                if h in self._blocks:
                    del self._lru[True][h]
                    self._lru[False][h] = None
                    self._lru[False].move_to_end(h, last=False)

    def needed_by(self, chain_hash: bytes) -> int:
        """Held checkpoints that need the block `chain_hash`."""
        return self._needed.get(chain_hash, 0)

    def evictable_hash(self, chain_hash: bytes) -> bool:
        """Whether `chain_hash`'s block is indexed and only the store holds it."""
        block = self._blocks.get(chain_hash)
        return block is not None and self.allocator.refcount(block) == 1

    def evictable(self) -> int:
        return sum(1 for b in self._blocks.values() if self.allocator.refcount(b) == 1)

    def evict_one(self, needed: bool = False) -> bytes | None:
        """Free the least recently used block only the store holds among those no checkpoint needs (with
        `needed`: among those some checkpoint needs); its chain hash, or None."""
        queue = self._lru[needed]
        for h in queue:
            block = self._blocks[h]
            if self.allocator.refcount(block) == 1:
                del queue[h]
                del self._blocks[h]
                del self._hash_of[block]
                self.allocator.release([block])
                if self.log is not None:
                    self.log.add(BlockRemoved([h]))
                return h
        return None

    def forget_all(self) -> None:
        """Drop the whole index and its references (the pool was rebuilt)."""
        self.allocator.release(list(self._blocks.values()))
        self._blocks.clear()
        self._hash_of.clear()
        for queue in self._lru.values():
            queue.clear()
        if self.log is not None:
            self.log.add(AllBlocksCleared())


def kv_match(
    tokens: Sequence[int],
    chain: list[bytes],
    block_size: int,
    blocks: BlockIndex,
    disk_refs: Any,
    tails: TailIndex,
    partial: bool,
) -> tuple[int, int, int]:
    """How far `tokens` (whose chain hashes are `chain`) find their KV in the store: (full blocks in the
    pool, full blocks in the pool or a disk entry (`disk_refs`), tokens matched: those blocks, then the
    longest tail seen after them; with `partial`, any common part of a tail counts, else a whole tail)."""
    nb = 0
    while nb + 1 < len(chain) and chain[nb + 1] in blocks:
        nb += 1
    reach = nb
    while reach + 1 < len(chain) and (chain[reach + 1] in blocks or chain[reach + 1] in disk_refs):
        reach += 1
    start = reach * block_size
    rest = list(tokens[start : start + block_size])
    matched = start
    for tail in tails.get(chain[reach]):
        if partial:
            matched = max(matched, start + common_prefix(rest, list(tail)))
        elif tuple(rest[: len(tail)]) == tail:
            matched = max(matched, start + len(tail))
    return nb, reach, matched

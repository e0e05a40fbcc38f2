"""What the prefix store tells the outside about its contents: KV-cache events in vLLM's shape (BlockStored,
BlockRemoved, AllBlocksCleared: what existing KV-event consumers read) and our own for state checkpoints
(StateStored, StateRemoved, AllStatesCleared: without a checkpoint, KV blocks resume nothing in a KDA layer).

The store appends events to an `EventLog` as its contents change; the server drains it after each engine step
and publishes them (`serve.http.kv_events`), the two families as separate batches under their own topics
(`KV_TOPIC`, `STATE_TOPIC`), so that a consumer of vLLM's events never meets a type it does not know. On the
wire a batch is msgpack of `[ts, [event, ...], dp_rank]` and each event an array whose first element is its
type's name, then its fields in declaration order (how vLLM encodes its msgspec structs, `array_like=True,
tag=True`). Block hashes are the store's 32-byte chain hashes; a block's parent is None for a sequence's
first block. `Contents` is what a stream of events says is held: the publisher keeps one to answer a late
subscriber with a snapshot, and a router keeps one per replica.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

import msgpack


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Full KV blocks newly cached, in chain order: `block_hashes[0]`'s parent is `parent_block_hash`."""

    TAG: ClassVar[str] = "BlockStored"
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # the blocks' tokens, block_size each
    block_size: int
    lora_id: int | None = None
    medium: str | None = "device"

    def blocks(self) -> Iterator[tuple[bytes, bytes | None, tuple[int, ...]]]:
        """(hash, parent hash, tokens) of each block, in chain order."""
        parent, bs = self.parent_block_hash, self.block_size
        for j, h in enumerate(self.block_hashes):
            yield h, parent, tuple(self.token_ids[j * bs : (j + 1) * bs])
            parent = h


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: list[bytes]
    medium: str | None = "device"


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    TAG: ClassVar[str] = "AllBlocksCleared"


@dataclasses.dataclass(frozen=True)
class StateStored:
    """A state checkpoint kept in `tier` (device, host, disk): the KDA states after `position` tokens, which
    are the full blocks up to `block_hash` (None: none) and then `tail` (position % block_size tokens). A
    request resumes from it only while those blocks are cached too (or `tier` is disk: it carries them)."""

    TAG: ClassVar[str] = "StateStored"
    key: bytes
    position: int
    kind: str  # serve.prefix.types.CheckpointKind
    tier: str
    block_hash: bytes | None
    tail: list[int]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StateRemoved:
    TAG: ClassVar[str] = "StateRemoved"
    key: bytes
    tier: str


@dataclasses.dataclass(frozen=True)
class AllStatesCleared:
    """Forget every checkpoint this publisher announced (the start of a snapshot)."""

    TAG: ClassVar[str] = "AllStatesCleared"


KV_TOPIC, STATE_TOPIC = "kv", "state"
Event = BlockStored | BlockRemoved | AllBlocksCleared | StateStored | StateRemoved | AllStatesCleared
KV_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)
STATE_TYPES = (StateStored, StateRemoved, AllStatesCleared)
TYPES: dict[str, type] = {t.TAG: t for t in (*KV_TYPES, *STATE_TYPES)}


def topic_of(event: Event) -> str:
    return KV_TOPIC if isinstance(event, KV_TYPES) else STATE_TOPIC


class EventLog:
    """Events in the order the store made them, until `drain`."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def __len__(self) -> int:
        return len(self._events)

    def add(self, event: Event) -> None:
        self._events.append(event)

    def drain(self) -> list[Event]:
        out, self._events = self._events, []
        return out


def blocks_stored(
    chain: Sequence[bytes], new: Sequence[int], tokens: Sequence[int], block_size: int
) -> list[BlockStored]:
    """BlockStored events for the newly indexed blocks `new` (indexes i >= 1 into `chain`, a sequence's chain
    hashes with the root first: entry i is its block i - 1, tokens[(i - 1) * block_size : i * block_size]):
    one per run of consecutive new blocks, its parent the block before the run (None: the root)."""
    out: list[BlockStored] = []
    run: list[int] = []
    for i in [*sorted(new), None]:
        if run and (i is None or i != run[-1] + 1):
            parent = chain[run[0] - 1] if run[0] > 1 else None
            start, stop = (run[0] - 1) * block_size, run[-1] * block_size
            out.append(
                BlockStored([chain[j] for j in run], parent, [int(t) for t in tokens[start:stop]], block_size)
            )
            run = []
        if i is not None:
            run.append(i)
    return out


def encode(events: Iterable[Event], ts: float | None = None, dp_rank: int = 0) -> bytes:
    """One batch on the wire (see the module doc)."""
    rows = [[e.TAG, *(getattr(e, f.name) for f in dataclasses.fields(e))] for e in events]
    return msgpack.packb([time.time() if ts is None else ts, rows, dp_rank], use_bin_type=True)


def decode(payload: bytes) -> tuple[float, list[Event], int]:
    """(ts, events, dp_rank) of a batch `encode` made; ValueError for anything else."""
    try:
        ts, rows, *rest = msgpack.unpackb(payload, raw=False)
        events = [TYPES[row[0]](*row[1:]) for row in rows]
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"not an event batch: {exc}") from None
    return float(ts), events, int(rest[0]) if rest else 0


@dataclasses.dataclass
class Contents:
    """What a stream of events says a store holds: cached blocks (hash -> parent, tokens) and checkpoints
    (key -> StateStored per tier)."""

    blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    states: dict[tuple[bytes, str], StateStored] = dataclasses.field(default_factory=dict)
    block_size: int = 0

    def apply(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.block_size = e.block_size
                for h, parent, tokens in e.blocks():
                    self.blocks[h] = (parent, tokens)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.blocks.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(e, StateStored):
                self.states[(e.key, e.tier)] = e
            elif isinstance(e, StateRemoved):
                self.states.pop((e.key, e.tier), None)
            elif isinstance(e, AllStatesCleared):
                self.states.clear()

    def snapshot(self, topic: str) -> list[Event]:
        """Events of `topic` that rebuild these contents from nothing: AllBlocksCleared and every block
        (parents before children), or AllStatesCleared and every checkpoint."""
        if topic == STATE_TOPIC:
            return [AllStatesCleared(), *self.states.values()]
        out: list[Event] = [AllBlocksCleared()]
        done: set[bytes] = set()

        def emit(h: bytes) -> None:
            path = []
            while h is not None and h not in done and h in self.blocks:
                path.append(h)
                h = self.blocks[h][0]
            for h in reversed(path):
                parent, tokens = self.blocks[h]
                out.append(BlockStored([h], parent, list(tokens), self.block_size))
                done.add(h)

        for h in list(self.blocks):
            emit(h)
        return out

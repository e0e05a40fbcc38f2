"""Which checkpoint the prefix store gives up first when a tier is over its budget. A policy only orders
keys; the store decides what may go (never a checkpoint a running request is restoring from).

`lru`: least recently inserted or used first (the fixed checkpoint policy's default).
`value`: lowest value per byte first, where a checkpoint's value is the prefill it saves (tokens from the
nearest checkpoint still held on its own chain, not from 0: dropping a checkpoint next to another costs
little) times how likely it is reused (its own hits, plus the hit rate its kind has had so far: sequence
ends in a chat are reused, interval checkpoints inside unique text rarely are), decayed by how many
checkpoints were taken since it was last used (the adaptive checkpoint policy's default).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from serve.prefix.checkpoints import Checkpoint


class EvictionPolicy(Protocol):
    def inserted(self, ck: Checkpoint) -> None: ...

    def used(self, key: Hashable) -> None:
        """Looked up or saved again (recency)."""
        ...

    def hit(self, key: Hashable) -> None:
        """Given to a request that resumes from it (reuse)."""
        ...

    def removed(self, key: Hashable) -> None: ...

    def order(self) -> Iterator[Hashable]:
        """Every key, the first to evict first."""
        ...


class LRU:
    """Least recently inserted or used first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, ck: Checkpoint) -> None:
        self._keys[ck.key] = None
        self._keys.move_to_end(ck.key)

    def used(self, key: Hashable) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def hit(self, key: Hashable) -> None:
        pass  # `used` at lookup already moved it

    def removed(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def order(self) -> Iterator[Hashable]:
        return iter(list(self._keys))


class ValueAware:
    """Lowest (saved tokens x reuse likelihood x recency) / bytes first; see the module doc."""

    MIN_HORIZON = 16  # checkpoints taken before an unused one's value halves, at least

    def __init__(self) -> None:
        self._live: dict[Hashable, Checkpoint] = {}
        self._lineage: dict[Hashable, tuple[Hashable | None, int]] = {}  # key -> (parent, position)
        self._hits: Counter[Hashable] = Counter()
        self._last: dict[Hashable, int] = {}
        self._kind_saves: Counter[str] = Counter()
        self._kind_hits: Counter[str] = Counter()
        self._clock = 0

    def inserted(self, ck: Checkpoint) -> None:
        self._clock += 1
        self._live[ck.key] = ck
        self._lineage[ck.key] = (ck.parent, ck.position)
        self._last[ck.key] = self._clock
        self._kind_saves[ck.kind] += 1

    def used(self, key: Hashable) -> None:
        if key in self._live:
            self._last[key] = self._clock

    def hit(self, key: Hashable) -> None:
        ck = self._live.get(key)
        if ck is not None:
            self._hits[key] += 1
            self._kind_hits[ck.kind] += 1
            self._last[key] = self._clock

    def removed(self, key: Hashable) -> None:
        self._live.pop(key, None)
        self._last.pop(key, None)
        self._hits.pop(key, None)  # the lineage stays: a child's gap walks through it

    def saved_tokens(self, ck: Checkpoint) -> int:
        """Tokens from the nearest checkpoint still held on `ck`'s chain (0: the start) to `ck`."""
        parent = ck.parent
        while parent is not None and parent not in self._live:
            parent = self._lineage.get(parent, (None, 0))[0]
        return ck.position - (self._lineage[parent][1] if parent is not None else 0)

    def value(self, ck: Checkpoint) -> float:
        kind_rate = (self._kind_hits[ck.kind] + 1) / (self._kind_saves[ck.kind] + 2)
        horizon = max(self.MIN_HORIZON, len(self._live))
        recency = 1.0 / (1.0 + (self._clock - self._last[ck.key]) / horizon)
        return self.saved_tokens(ck) * (self._hits[ck.key] + kind_rate) * recency / max(ck.nbytes, 1)

    def order(self) -> Iterator[Hashable]:
        ranked = sorted(self._live.values(), key=lambda c: (self.value(c), self._last[c.key]))
        return iter([c.key for c in ranked])


POLICIES = {"lru": LRU, "value": ValueAware}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})") from None

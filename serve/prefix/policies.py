"""Which checkpoint the prefix store gives up first when a tier is over its budget. A policy only orders
keys; the store decides what may go (never a checkpoint a running request is restoring from).

`lru`: least recently inserted or used first (the fixed checkpoint policy's default).
`value`: lowest value per byte first, where a checkpoint's value is the prefill it saves (tokens from the
nearest checkpoint still held on its own chain, not from 0: dropping a checkpoint next to another costs
little), scaled down when a held checkpoint sits just below it on its chain (the prompts that leave the
chain past that one resume there, not here: of an interval checkpoint 4 tokens above a junction, the
junction is kept), times how likely it is reused (the hit rate its kind has had so far, a lookup that
would have resumed from a dropped one counting: sequence ends in a chat are reused, interval checkpoints
inside unique text rarely are), decayed by how many prompts were looked up since it was saved or last
resumed from (the adaptive checkpoint policy's default).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator

from serve.prefix.types import Checkpoint, EvictionPolicy


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

    def looked_up(self) -> None:
        pass

    def order(self) -> Iterator[Hashable]:
        return iter(list(self._keys))

    def dropped(self, key: Hashable) -> bool:
        return False

    def missed(self, key: Hashable) -> None:
        pass


class ValueAware:
    """Lowest (saved tokens x share x reuse likelihood x recency) / bytes first; see the module doc.

    Share: min(1, below / saved), `below` the tokens to the nearest held checkpoint deeper on its chain (if
    it has one): with prompts leaving a chain anywhere alike, the part of them this one serves. Reuse
    likelihood is the hit rate of the checkpoint's kind so far (hits / saves, smoothed and clamped to
    [MIN_RATE, 1]; a lookup that passed a dropped checkpoint it would have resumed from, a ghost of the last
    MIN_GHOSTS or twice as many as held, is a hit of its kind: without it a kind dropped before its reuse
    never shows any), not the checkpoint's own hit count: a count entrenches a checkpoint that a deeper one
    on its chain has superseded (it keeps being the best hit only while the deeper one is not kept). Recency
    is 1 / (1 + age / horizon), age in lookups since it was saved or last resumed from, horizon the number
    of checkpoints held (at least MIN_HORIZON): the longer the store's memory, the slower a checkpoint ages.
    The constants were chosen on the chat, docqa and agentic workload families of `bench prefix
    --simulate`, not on longdoc and sysprompt."""

    MIN_RATE = 0.25
    MIN_HORIZON = 4
    MIN_GHOSTS = 64

    def __init__(self) -> None:
        self._live: dict[Hashable, Checkpoint] = {}
        self._lineage: dict[Hashable, tuple[Hashable | None, int]] = {}  # key -> (parent, position)
        self._children: Counter[Hashable] = Counter()  # key -> lineage entries naming it as their parent
        self._last: dict[Hashable, int] = {}
        self._kind_saves: Counter[str] = Counter()
        self._kind_hits: Counter[str] = Counter()
        self._ghosts: OrderedDict[Hashable, str] = OrderedDict()  # dropped lately: key -> kind
        self._clock = 0

    def looked_up(self) -> None:
        self._clock += 1

    def dropped(self, key: Hashable) -> bool:
        return key in self._ghosts

    def missed(self, key: Hashable) -> None:
        kind = self._ghosts.pop(key, None)
        if kind is not None:
            self._kind_hits[kind] += 1

    def inserted(self, ck: Checkpoint) -> None:
        self._live[ck.key] = ck
        old = self._lineage.get(ck.key)
        if old is not None and old[0] is not None:
            self._unref(old[0])
        self._lineage[ck.key] = (ck.parent, ck.position)
        if ck.parent is not None:
            self._children[ck.parent] += 1
        self._last[ck.key] = self._clock
        self._kind_saves[ck.kind] += 1

    def used(self, key: Hashable) -> None:
        pass  # a lookup that found it is not yet a reuse (`hit` is)

    def hit(self, key: Hashable) -> None:
        ck = self._live.get(key)
        if ck is not None:
            self._kind_hits[ck.kind] += 1
            self._last[key] = self._clock

    def removed(self, key: Hashable) -> None:
        ck = self._live.pop(key, None)
        self._last.pop(key, None)
        if ck is not None:  # a ghost: a lookup that would have resumed from it credits its kind
            self._ghosts[key] = ck.kind
            while len(self._ghosts) > max(self.MIN_GHOSTS, 2 * len(self._live)):
                self._ghosts.popitem(last=False)
        self._prune(key)  # the lineage stays only while a child's saved tokens may walk through it

    def _unref(self, key: Hashable) -> None:
        self._children[key] -= 1
        if self._children[key] <= 0:
            del self._children[key]
            self._prune(key)

    def _prune(self, key: Hashable) -> None:
        """Forget `key`'s lineage once it is neither held nor the parent of a lineage entry (and so up its
        chain)."""
        while key is not None and key not in self._live and not self._children[key] and key in self._lineage:
            self._children.pop(key, None)
            parent = self._lineage.pop(key)[0]
            if parent is not None:
                self._children[parent] -= 1
                if self._children[parent] > 0:
                    return
                del self._children[parent]
            key = parent

    def held_parent(self, ck: Checkpoint) -> Hashable | None:
        """The nearest checkpoint still held on `ck`'s chain (None: the start)."""
        parent = ck.parent
        while parent is not None and parent not in self._live:
            parent = self._lineage.get(parent, (None, 0))[0]
        return parent

    def saved_tokens(self, ck: Checkpoint) -> int:
        """Tokens from the nearest checkpoint still held on `ck`'s chain (0: the start) to `ck`."""
        parent = self.held_parent(ck)
        return ck.position - (self._lineage[parent][1] if parent is not None else 0)

    def reuse_rate(self, kind: str) -> float:
        rate = (self._kind_hits[kind] + 1) / (self._kind_saves[kind] + 2)
        return min(1.0, max(self.MIN_RATE, rate))

    def value(self, ck: Checkpoint, below: int | None = None) -> float:
        """`below`: tokens to the nearest held checkpoint deeper on its chain, if any (`order` finds them)."""
        horizon = max(self.MIN_HORIZON, len(self._live))
        recency = 1.0 / (1.0 + (self._clock - self._last[ck.key]) / horizon)
        saved = self.saved_tokens(ck)
        value = saved * self.reuse_rate(ck.kind) * recency / max(ck.nbytes, 1)
        if below is not None:  # it serves only the prompts that leave its chain before the next held one
            value *= min(1.0, below / max(saved, 1))
        return value

    def order(self) -> Iterator[Hashable]:
        below: dict[Hashable, int] = {}
        for c in self._live.values():
            parent = self.held_parent(c)
            if parent is not None:
                gap = c.position - self._live[parent].position
                below[parent] = min(below.get(parent, gap), gap)
        ranked = sorted(
            self._live.values(), key=lambda c: (self.value(c, below.get(c.key)), self._last[c.key])
        )
        return iter([c.key for c in ranked])


POLICIES = {"lru": LRU, "value": ValueAware}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})") from None

"""Which checkpoint the prefix store gives up first when a tier is over its budget. A policy only orders
keys; the store decides what may go (never a checkpoint a running request is restoring from)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def inserted(self, key: Hashable) -> None: ...

    def used(self, key: Hashable) -> None: ...

    def removed(self, key: Hashable) -> None: ...

    def order(self) -> Iterator[Hashable]:
        """Every key, the first to evict first."""
        ...


class LRU:
    """Least recently inserted or used first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def used(self, key: Hashable) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def order(self) -> Iterator[Hashable]:
        return iter(list(self._keys))


POLICIES = {"lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})") from None

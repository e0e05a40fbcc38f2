"""Offline checkpoint placement: the dynamic program of sparse prefix caching ("Sparse Prefix Caching for
Hybrid/Recurrent LLM Serving", arXiv 2605.05219) over a tree of prompts instead of one sequence.

Known in advance: every request's prompt and its overlap depth q (the longest prefix it shares with what ran
before it). A request resumes from the deepest kept state at or above depth q on its own path and recomputes
the rest, so it pays q - (that state's depth) over what it must compute anyway. `place` chooses the states
(trie nodes) to keep, within a byte budget (a state at an unaligned position also keeps its partial block's
KV), that minimise the sum of those payments: exact, by a knapsack over the tree of branch and query nodes
and the block boundary above each (elsewhere a state is worth no more than at the next such node down).
`Placement` is what the store is given (`PrefixStoreConfig.placement`): it checkpoints there and nowhere
else. A comparison policy for `bench prefix` (the reference an online policy should approach), not a
serving one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np


def digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class Placement:
    """The positions to checkpoint, as token prefixes: their lengths (`depths`) and digests."""

    prefixes: frozenset[bytes]
    depths: tuple[int, ...]  # ascending, distinct
    cost: int = 0  # the recompute the program predicts (tokens beyond the lower bound)

    def positions(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """The placed positions on `tokens` (ascending)."""
        data = np.asarray(tokens, np.int32)
        return [d for d in self.depths if d <= len(data) and digest(data[:d]) in self.prefixes]

    def holds(self, tokens: Sequence[int] | np.ndarray, position: int) -> bool:
        """Whether the prefix of `tokens` of length `position` is placed."""
        return self.at(position) and digest(np.asarray(tokens[:position], np.int32)) in self.prefixes

    def wait_point(self, prompt: Sequence[int], shared: int, computed: int) -> int | None:
        """Where a prompt that shares `shared` tokens with a running request that has computed `computed`
        waits for it: the deepest placed position in the shared part not computed yet (None: nowhere)."""
        placed = [p for p in self.positions(prompt[:shared]) if p > computed]
        return placed[-1] if placed else None

    def at(self, position: int) -> bool:
        """Whether some prefix of length `position` is placed."""
        return position in self._depths

    @functools.cached_property
    def _depths(self) -> frozenset[int]:
        return frozenset(self.depths)


@dataclasses.dataclass
class _Node:
    depth: int
    prefix: bytes
    weight: int  # bytes-units its state costs
    queries: int = 0  # requests whose overlap depth ends here
    children: list[int] = dataclasses.field(default_factory=list)
    ancestors: tuple[int, ...] = ()  # node ids root first (the root is -1, depth 0)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _tree(paths: list[np.ndarray], unit_of: Callable[[int], int], block_size: int) -> list[_Node]:
    """The tree of the positions worth a state on `paths` (each a prompt cut at its overlap depth), in an
    order where every node comes after its parent: query and branch nodes, and above each the deepest
    block boundary on the edge to its parent (a state there costs less than one off the blocks; elsewhere on
    an edge a state is never better than at the edge's lower end). Branch depths on a path are its longest
    common prefixes with the others, found between neighbours in sorted order (prefix minima)."""
    order = sorted(range(len(paths)), key=lambda i: paths[i].tobytes())  # any lexicographic order will do
    adjacent = [_lcp(paths[order[k]], paths[order[k + 1]]) for k in range(len(order) - 1)]
    nodes: list[_Node] = []
    by_prefix: dict[bytes, int] = {}
    for rank, i in enumerate(order):
        path, depths = paths[i], {len(paths[i])}
        for step in (-1, 1):  # the common prefix with each other path, walking away in sorted order
            low, k = len(path), rank
            while 0 <= k + step < len(order) and low > 0:
                low = min(low, adjacent[min(k, k + step)])
                depths.add(low)
                k += step
        depths |= {d // block_size * block_size for d in depths}
        parent, ancestors = -1, (-1,)
        for d in sorted(x for x in depths if x > 0):
            key = digest(path[:d])
            node = by_prefix.get(key)
            if node is None:
                node = by_prefix[key] = len(nodes)
                nodes.append(_Node(d, key, unit_of(d), ancestors=ancestors))
                if parent >= 0:
                    nodes[parent].children.append(node)
            parent, ancestors = node, (*ancestors, node)
        nodes[parent].queries += 1
    return nodes


def _conv(a: np.ndarray, b: np.ndarray, size: int) -> np.ndarray:
    """Min-plus convolution of two 'at most b units' cost arrays, cut to `size` entries."""
    if len(a) > len(b):
        a, b = b, a
    n = min(len(a) + len(b) - 1, size)
    out = np.full(n, np.inf)
    for i in range(min(len(a), n)):
        m = min(len(b), n - i)
        np.minimum(out[i : i + m], a[i] + b[:m], out=out[i : i + m])
    if n > len(b):  # a budget beyond both arrays' ends buys nothing more
        out = np.minimum.accumulate(out)
    return out


def _at(a: np.ndarray, b: int) -> float:
    return float(a[min(b, len(a) - 1)])


class _Program:
    """The knapsack over the tree: F[v][a][b], the least payment of v's subtree with `a` the nearest kept
    ancestor above v and at most b units kept in the subtree."""

    def __init__(self, nodes: list[_Node], units: int):
        self.nodes, self.units = nodes, units
        self.depth = {-1: 0, **{i: n.depth for i, n in enumerate(nodes)}}
        self.roots = [i for i, n in enumerate(nodes) if n.ancestors == (-1,)]
        self.f: dict[int, dict[int, np.ndarray]] = {}
        for v in reversed(range(len(nodes))):  # children before parents
            self._solve(v)

    def _merge(self, children: list[int], context: int) -> np.ndarray:
        out = np.zeros(1)
        for c in children:
            out = _conv(out, self.f[c][context], self.units + 1)
        return out

    def _kept(self, v: int) -> np.ndarray:
        """v's subtree with v kept (units shifted by v's weight)."""
        node = self.nodes[v]
        inner = self._merge(node.children, v)
        if node.weight > self.units:
            return np.full(1, np.inf)
        size = min(len(inner) + node.weight, self.units + 1)
        return np.concatenate([np.full(node.weight, np.inf), inner[: size - node.weight]])

    def _solve(self, v: int) -> None:
        node, kept = self.nodes[v], self._kept(v)
        self.f[v] = {}
        for a in node.ancestors:
            skip = self._merge(node.children, a) + node.queries * (node.depth - self.depth[a])
            n = max(len(skip), len(kept))
            both = np.minimum(
                np.concatenate([skip, np.full(n - len(skip), skip[-1])]),
                np.concatenate([kept, np.full(n - len(kept), kept[-1])]),
            )
            self.f[v][a] = np.minimum.accumulate(both)

    def cost(self) -> float:
        return _at(self._merge(self.roots, -1), self.units)

    def chosen(self) -> list[int]:
        out: list[int] = []
        self._split(self.roots, -1, self.units, out)
        return out

    def _split(self, children: list[int], context: int, units: int, out: list[int]) -> None:
        """Give each of `children` its share of `units` (as the optimum did), then place within each."""
        prefix = [np.zeros(1)]
        for c in children:
            prefix.append(_conv(prefix[-1], self.f[c][context], self.units + 1))
        for k in range(len(children) - 1, -1, -1):
            target, f = _at(prefix[k + 1], units), self.f[children[k]][context]
            share = next(
                s
                for s in range(min(units, len(f) - 1) + 1)
                if _at(prefix[k], units - s) + f[s] <= target + 1e-9
            )
            self._place(children[k], context, share, out)
            units -= share

    def _place(self, v: int, context: int, units: int, out: list[int]) -> None:
        node = self.nodes[v]
        kept = self._kept(v)
        if _at(kept, units) <= _at(self.f[v][context], units):
            out.append(v)
            self._split(node.children, v, units - node.weight, out)
        else:
            self._split(node.children, context, units, out)


def place(
    queries: Sequence[tuple[np.ndarray, int]],
    budget_bytes: int,
    state_bytes: int,
    partial_bytes: int,
    block_size: int,
    max_units: int = 4096,
) -> Placement:
    """The placement of least recompute within `budget_bytes`. `queries`: per request, (its prompt, its
    overlap depth). A state costs `state_bytes`, `partial_bytes` at a position off the blocks. Bytes are
    counted in units of their greatest common divisor (exact), coarser when the budget holds more than
    `max_units` of them (then each cost is rounded up: the placement still fits)."""
    unit = math.gcd(state_bytes, partial_bytes) or 1
    unit = max(unit, math.ceil(budget_bytes / max_units))
    paths = [np.asarray(p[:q], np.int32) for p, q in queries if q > 0]
    if not paths:
        return Placement(frozenset(), ())

    def unit_of(depth: int) -> int:
        return math.ceil((partial_bytes if depth % block_size else state_bytes) / unit)

    nodes = _tree(paths, unit_of, block_size)
    program = _Program(nodes, budget_bytes // unit)
    chosen = program.chosen()
    return Placement(
        frozenset(nodes[v].prefix for v in chosen),
        tuple(sorted({nodes[v].depth for v in chosen})),
        int(program.cost()),
    )

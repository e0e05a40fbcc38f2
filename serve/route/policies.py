"""Which replica a request goes to.

`state-aware` (the default): the replica that could resume the prompt from the deepest state checkpoint
whose KV blocks it also holds (`ReplicaIndex.match(...).resumable`; cached KV beyond it counts
`KV_AFFINITY` a token), against the prefill already queued there: the cost of a replica is the prompt tokens
it would compute plus `load_weight` x the prompt tokens of its requests not yet past their first token
(`Backend.queued`: what a new request's first token waits for; a request that decodes shares the replica's
steps with a newcomer's prefill at little cost to it); the cheapest wins (ties: fewer requests in flight,
then turn). A prompt that shares a prefix with one routed to a replica and not done yet counts that prefix
as resumable there too: the events show it only once it is computed, and the replica's store computes a
shared prefix once. A request that continues no chain a replica keeps (`ReplicaIndex.chains`: the latest
states of its conversations) adds one there; where the chains already fill the store's capacity (its
/health's `checkpoint_capacity`, `CHECKPOINTS_PER_CHAIN` a chain) it pushes another one out, and that
costs `EVICT_WEIGHT` x the prompt's own part (beyond the prefix the best replica holds) on top.
`kv-only`: the same with the cached KV blocks alone (what routers that read KV events do; for a hybrid model
it overrates a replica whose blocks have no checkpoint above them). `round-robin`: in turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

from serve.route.backends import Backend
from serve.route.index import block_keys

# What a token of cached KV above a replica's deepest usable checkpoint is worth, against a token it resumes
# from: it resumes nothing now, but the replica's store checkpoints where the prompt leaves it (a junction),
# and a conversation kept on one replica keeps its checkpoints there (measured: `bench route --simulate`).
KV_AFFINITY = 0.5
LOAD_WEIGHT = 0.3  # a prompt token queued at a replica (`Backend.queued`) against one it must compute
# Checkpoints of a store's capacity a chain takes without pushing another one's latest out: that one, the
# one it takes while it computes the next turn, and its share of the prefixes the chains have in common.
# What a chain pushed out costs: its next turns compute their own part again (more than once on a store
# past its capacity), against a new chain's own part. Both measured: `bench route --simulate --workload
# chat,agentic --device-cache-mb 0.05..0.4 --host-cache-mb 0` (`git show 9bb8ba5:BENCHMARKS.md`).
CHECKPOINTS_PER_CHAIN = 2.5
EVICT_WEIGHT = 2.0
PENDING_BLOCK = 16  # tokens per block of the prefixes of requests routed and not yet done


class Policy(StrEnum):
    STATE_AWARE = "state-aware"
    KV_ONLY = "kv-only"
    ROUND_ROBIN = "round-robin"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A replica for a request, with the prefill it is expected to save there and the prefill it adds."""

    backend: Backend
    saved: int  # prompt tokens the replica is expected not to compute
    prefill: int  # prompt tokens it is expected to compute
    prefixes: tuple[bytes, ...] = ()  # `prefix_digests` of the prompt (what it adds to `Backend.pending`)
    new_chain: bool = False  # it continues no chain the replica keeps (`Backend.start`)
    evicts: float = 0.0  # prompt tokens another chain there is expected to compute again (a full store)


def prefix_digests(tokens: Sequence[int], block: int = PENDING_BLOCK) -> tuple[bytes, ...]:
    """A digest of each of the prompt's block-aligned prefixes (the i-th: its first (i + 1) x `block`
    tokens), so that prompts routed but not yet computed can be matched by their shared prefix."""
    h, out = hashlib.blake2b(digest_size=16), []
    for key in block_keys(tokens, block):
        h.update(key)
        out.append(h.copy().digest())
    return tuple(out)


def pending_match(prefixes: tuple[bytes, ...], pending: Counter[bytes], block: int = PENDING_BLOCK) -> int:
    """Tokens of the deepest block-aligned prefix a prompt shares with one routed to a replica and not yet
    done there (its store computes a shared prefix once: the later request waits for its checkpoint)."""
    lo, hi = 0, len(prefixes)  # prefixes are nested: a binary search finds the deepest one held
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pending.get(prefixes[mid - 1], 0) > 0:
            lo = mid
        else:
            hi = mid - 1
    return lo * block


class Chooser:
    def __init__(self, backends: Sequence[Backend], policy: Policy, load_weight: float = LOAD_WEIGHT):
        self.backends, self.policy, self.load_weight = list(backends), Policy(policy), load_weight
        self._turn = itertools.count()

    def rank(self, tokens: Sequence[int]) -> list[Candidate]:
        """Every healthy replica, the one to try first first (the rest: where to retry)."""
        healthy = [b for b in self.backends if b.healthy]
        if not healthy:
            return []
        turn = next(self._turn) % len(healthy)
        rotated = healthy[turn:] + healthy[:turn]
        prefixes = prefix_digests(tokens) if self.policy is Policy.STATE_AWARE else ()
        out, keys = [], {}  # block size -> the prompt's block_keys (the replicas of one model share one)
        for b in rotated:
            with b.lock:
                bs = b.index.block_size
                if tokens and bs and bs not in keys:
                    keys[bs] = block_keys(tokens, bs)
                m = b.index.match(tokens, keys.get(bs)) if tokens else None
            if self.policy is Policy.STATE_AWARE and m is not None:
                saved = m.resumable + KV_AFFINITY * (m.kv_tokens - m.resumable)
                saved = max(saved, pending_match(prefixes, b.pending))
            elif self.policy is Policy.KV_ONLY and m is not None:
                saved = m.kv_tokens
            else:
                saved = 0
            new_chain = bool(tokens) and not (m is not None and m.continues)
            out.append(Candidate(b, saved, len(tokens) - saved, prefixes, new_chain))
        if self.policy is Policy.ROUND_ROBIN:
            return out
        if self.policy is Policy.STATE_AWARE:
            out = self._weigh_capacity(out)
        order = {id(c.backend): i for i, c in enumerate(out)}
        cost = lambda c: (  # noqa: E731
            c.prefill + c.evicts + self.load_weight * c.backend.queued,
            c.backend.in_flight,
        )
        return sorted(out, key=lambda c: (*cost(c), order[id(c.backend)]))

    @staticmethod
    def _weigh_capacity(out: list[Candidate]) -> list[Candidate]:
        """A new chain on a replica whose store keeps as many chains as its capacity allows pushes one out:
        that chain's next turns compute again about what this one computes of its own (the prompt beyond the
        prefix the best replica holds), and on a replica past its capacity they are pushed out again."""
        own = min(c.prefill for c in out)
        return [
            dataclasses.replace(c, evicts=EVICT_WEIGHT * own)
            if c.new_chain
            and c.backend.capacity is not None
            and (c.backend.chains + 1) * CHECKPOINTS_PER_CHAIN > c.backend.capacity
            else c
            for c in out
        ]

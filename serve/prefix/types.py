"""The prefix store's typed data and the protocols its parts meet each other through: the tiers, a
checkpoint and why it was taken, what the store reads of a request (`Sequence_`), where its copies come
from (`CheckpointSource`, the engine's runner), and the order a tier gives checkpoints up in
(`EvictionPolicy`). It imports nothing else of `serve.prefix`, so every part can depend on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from enum import StrEnum
from typing import Any, Protocol


class Tier:
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"  # the write-through copies (`serve.prefix.disk`), not a tier a Checkpoint lives in


TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class CheckpointKind(StrEnum):
    """Why the store took a checkpoint; the value is what disk metadata records. Where several are due at
    one position the first in this order is it (one checkpoint per position)."""

    INTERVAL = "interval"  # a multiple of the checkpoint interval
    PROMPT_END = "prompt_end"  # the end of a prompt (keeps its next-token logits)
    SEQUENCE_END = "sequence_end"  # the last computed position of a finished sequence
    JUNCTION = "junction"  # where a prompt leaves a prefix others hold or compute (adaptive policy)


@dataclasses.dataclass
class Checkpoint:
    """KDA states after `position` tokens (+ the partial last block's KV when position % block_size)."""

    key: bytes
    position: int
    states: Any  # per KDA layer (conv, state): device arrays, or numpy on the host tier
    tail_kv: Any  # per MLA layer [block_size, latent] (first position % block_size rows valid), or None
    nbytes: int
    tier: str  # Tier.DEVICE | Tier.HOST
    kind: CheckpointKind
    holders: int = 0  # running requests restoring from it right now (never evicted while > 0)
    logits: Any = (
        None  # [vocab] next-token logits at `position` (prompt ends): an identical prompt hits fully
    )
    parent: bytes | None = None  # the checkpoint before it on its chain (where its request resumed or last
    # saved), for what it saves (`serve.prefix.policies.ValueAware`)
    chain: tuple[bytes, ...] = ()  # chain hashes of the full blocks below it (it resumes nothing without)
    tail: tuple[int, ...] = ()  # the tokens after its last full block

    @property
    def base(self) -> bytes | None:
        """The chain hash of its last full block (None before the first block boundary)."""
        return self.chain[-1] if self.chain else None


class Sequence_(Protocol):
    """What the store reads of a request."""

    prompt: list[int]
    num_computed: int
    blocks: list[int]
    slot: int | None
    cache_salt: str | None
    cuts: set[int]  # positions the adaptive policy checkpoints at (junctions), where prefill chunks end
    checkpoint_base: bytes | None  # the checkpoint it resumed from or last took (its next one's parent)
    chain: list[bytes]  # chain hashes of its full blocks (root first), extended as it grows or is looked up
    indexed_blocks: int  # its leading blocks indexed since it got its current blocks (reset on preemption)

    @property
    def tokens(self) -> list[int]: ...


class CheckpointSource(Protocol):
    """Where the store's copies come from (the engine's runner)."""

    def take(self, slot: int, block: int) -> tuple[Any, Any]: ...

    def gather(self, blocks: list[int]) -> Any: ...

    def gathered_bytes(self, blocks: int) -> int: ...

    def pack(self, states: Any, kv_full: Any, num_full: int, tail: Any) -> dict[str, Any]: ...

    def to_host(self, tree: Any) -> Any: ...


class EvictionPolicy(Protocol):
    """The order a tier gives its checkpoints up in (`serve.prefix.policies`); it only orders keys."""

    def inserted(self, ck: Checkpoint) -> None: ...

    def used(self, key: Hashable) -> None:
        """Looked up or saved again (recency)."""
        ...

    def hit(self, key: Hashable) -> None:
        """Given to a request that resumes from it (reuse)."""
        ...

    def removed(self, key: Hashable) -> None: ...

    def looked_up(self) -> None:
        """A prompt was looked up (the clock recency is measured in)."""
        ...

    def order(self) -> Iterator[Hashable]:
        """Every key, the first to evict first."""
        ...

    def dropped(self, key: Hashable) -> bool:
        """Whether `key` was removed lately (a ghost the policy remembers)."""
        ...

    def missed(self, key: Hashable) -> None:
        """A lookup would have resumed from the removed `key`."""
        ...

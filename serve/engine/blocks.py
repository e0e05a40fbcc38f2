"""Block allocation for the paged latent-KV pools, with reference counts.

One allocator serves every MLA layer: a block id addresses the same slot in each layer's pool. Block 0
is the scratch block (padded tokens are written there) and is never handed out. A block returns to
the free list when its last holder releases it, so two sequences may share a full block (the prefix
store relies on this).
"""

from __future__ import annotations

from collections import deque

from jaxhybrid.cache import SCRATCH_BLOCK


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for an allocation (the scheduler preempts instead of failing)."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block {SCRATCH_BLOCK} is scratch), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._refs = [0] * num_blocks

    @property
    def usable(self) -> int:
        """Blocks that can ever be allocated (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.usable - self.num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with refcount 1; raises OutOfBlocks (allocating nothing) if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """Add a holder to blocks that are already allocated."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one holder from each block; blocks nobody holds become free."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} released more often than held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

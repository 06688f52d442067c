"""Reference-counted allocator of paged-cache blocks."""

from __future__ import annotations

from collections import Counter

from metrale.errors import CacheError, OutOfCacheBlocksError

#: Block id reserved for padding rows; never handed out, never freed.
DUMMY_BLOCK = 0


class BlockAllocator:
    """Hands out block ids ``1..num_blocks`` (id 0 is the dummy block).

    A block is free when its reference count is 0. :meth:`allocate` returns blocks with count 1;
    sharing a block (prefix cache) increments it; :meth:`free` decrements and returns a block to
    the free list when it reaches 0. Freeing a free block raises :class:`CacheError`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise CacheError(f"a block allocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * (num_blocks + 1)
        # Popped from the end: hand out low ids first, which keeps tests readable.
        self._free = list(range(num_blocks, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, all or nothing."""
        if count > len(self._free):
            raise OutOfCacheBlocksError(
                f"need {count} free KV blocks, only {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to an allocated block."""
        self._check(block)
        self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free."""
        for block, count in Counter(blocks).items():
            self._check(block)
            if count > self._ref_counts[block]:
                raise CacheError(f"block {block} freed {count} times but has {self._ref_counts[block]} references")
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def _check(self, block: int) -> None:
        if not 1 <= block <= self.num_blocks:
            raise CacheError(f"block id {block} is not in 1..{self.num_blocks}")
        if self._ref_counts[block] == 0:
            raise CacheError(f"block {block} is already free")

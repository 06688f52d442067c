"""Reference-counted allocator of paged-cache blocks."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable

from metrale.errors import CacheError, OutOfCacheBlocksError

#: Block id reserved for padding rows; never handed out, never freed.
DUMMY_BLOCK = 0


class BlockAllocator:
    """Hands out block ids ``1..num_blocks`` (id 0 is the dummy block).

    A block is in use while its reference count is above 0. :meth:`allocate` returns blocks with
    count 1; sharing a block (prefix cache) increments it; :meth:`free` decrements it. A block
    reaching 0 goes back to the free list -- unless it is *retained* (the prefix cache holds its
    contents): then it is kept, evictable, in least-recently-freed order. :meth:`allocate` takes
    free blocks first and evicts retained ones (oldest first, telling ``on_evict``) when it runs
    short; :meth:`share` on an evictable block takes it back into use. Freeing a block that is
    not in use raises :class:`CacheError`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise CacheError(f"a block allocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * (num_blocks + 1)
        # Popped from the end: hand out low ids first, which keeps tests readable.
        self._free = list(range(num_blocks, 0, -1))
        self._retained: set[int] = set()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: Called with a retained block's id when it is evicted for reuse.
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out: free ones plus evictable retained ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks, all or nothing (evicting retained ones if the free list is short)."""
        if count > self.num_free:
            raise OutOfCacheBlocksError(
                f"need {count} free KV blocks, only {self.num_free} of {self.num_blocks} are free"
            )
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._retained.discard(block)
                if self.on_evict is not None:
                    self.on_evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to a block in use, or take an evictable retained block back into use."""
        if block in self._evictable:
            del self._evictable[block]
            self._ref_counts[block] = 1
            return
        self._check(block)
        self._ref_counts[block] += 1

    def retain(self, block: int) -> None:
        """Keep ``block`` (in use) when its last reference goes, until it is evicted."""
        self._check(block)
        self._retained.add(block)

    def is_retained(self, block: int) -> bool:
        return block in self._retained

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free (or evictable)."""
        for block, count in Counter(blocks).items():
            self._check(block)
            if count > self._ref_counts[block]:
                raise CacheError(f"block {block} freed {count} times but has {self._ref_counts[block]} references")
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._retained:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _check(self, block: int) -> None:
        if not 1 <= block <= self.num_blocks:
            raise CacheError(f"block id {block} is not in 1..{self.num_blocks}")
        if self._ref_counts[block] == 0:
            raise CacheError(f"block {block} is already free")

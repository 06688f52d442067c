"""Reference-counted allocator of paged-cache blocks.

Every mutating method first checks its arguments and computes everything it will change, then
commits in one statement on one line, built from assignments and built-in calls only (the cache,
prefix cache and scheduler follow the same rule, marked ``# Commit``). An exception raised
between any two lines -- a ``KeyboardInterrupt`` included -- therefore finds the allocator either
untouched or fully updated, never half-way; :meth:`BlockAllocator.check` states the invariants
that hold at every line boundary. A commit that needs an owner's record updated too (a block
table) takes it as an argument and updates it in the same statement.
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from itertools import islice
from typing import Callable

import numpy as np

from metrale.errors import CacheError, OutOfCacheBlocksError

#: Called with the ids of retained blocks about to be evicted for reuse (see ``on_evict``).
EvictCallback = Callable[[list[int]], None]

#: Block id reserved for padding rows; never handed out, never freed.
DUMMY_BLOCK = 0


class BlockAllocator:
    """Hands out block ids ``1..num_blocks`` (id 0 is the dummy block).

    A block is in use while its reference count is above 0. :meth:`allocate` returns blocks with
    count 1; sharing a block (prefix cache) increments it; :meth:`free` decrements it. A block
    reaching 0 goes back to the free list -- unless it is *retained* (the prefix cache holds its
    contents): then it is kept, evictable, in least-recently-freed order. :meth:`allocate` takes
    free blocks first and evicts retained ones (oldest first, telling ``on_evict`` before it
    hands them out) when it runs short; :meth:`share` on an evictable block takes it back into
    use. Freeing a block that is not in use raises :class:`CacheError`.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise CacheError(f"a block allocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = np.zeros(num_blocks + 1, dtype=np.int64)
        # Popped from the end: hand out low ids first, which keeps tests readable.
        self._free = list(range(num_blocks, 0, -1))
        self._retained: set[int] = set()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._on_evict: EvictCallback | weakref.WeakMethod[EvictCallback] | None = None

    @property
    def on_evict(self) -> EvictCallback | None:
        """Called with the ids of retained blocks about to be evicted for reuse. Held weakly
        when it is a bound method, so an owner that registers itself forms no reference cycle."""
        return self._on_evict() if isinstance(self._on_evict, weakref.WeakMethod) else self._on_evict

    @on_evict.setter
    def on_evict(self, callback: EvictCallback | None) -> None:
        self._on_evict = weakref.WeakMethod(callback) if callback is not None and hasattr(callback, "__self__") else callback

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out: free ones plus evictable retained ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_in_use(self) -> int:
        """Blocks with a reference count above 0."""
        return self.num_blocks - self.num_free

    def ref_count(self, block: int) -> int:
        return int(self._ref_counts[block])

    def allocate(self, count: int, into: list[int] | None = None) -> list[int]:
        """Take ``count`` blocks, all or nothing (evicting retained ones if the free list is short).

        ``into`` (an owner's block table) is extended with them in the statement that takes
        them, so no interrupt can separate the blocks from their owner."""
        if count > self.num_free:
            raise OutOfCacheBlocksError(
                f"need {count} free KV blocks, only {self.num_free} of {self.num_blocks} are free"
            )
        if count <= 0:
            return []
        from_free = min(count, len(self._free))
        keep = len(self._free) - from_free
        evicted = list(islice(self._evictable, count - from_free))
        blocks = self._free[keep:][::-1] + evicted
        callback = self.on_evict
        if evicted and callback is not None:
            # The owner forgets the blocks before they are reused: an interrupt right after this
            # leaves them evictable and unclaimed (harmless), never claimed and overwritten.
            callback(evicted)
        into = [] if into is None else into
        # Commit.
        self._free[keep:], self._ref_counts[blocks], into[len(into):], _ = [], 1, blocks, self._forget(evicted)
        return blocks

    def _forget(self, evicted: list[int]) -> None:
        # Built-in operations only, called as the last part of allocate's commit.
        if evicted:
            self._retained.difference_update(evicted), list(map(self._evictable.pop, evicted))

    def share(self, block: int) -> None:
        """Add a reference to a block in use, or take an evictable retained block back into use."""
        if block in self._evictable:
            self._ref_counts[block], _ = 1, self._evictable.pop(block)
            return
        self._check(block)
        self._ref_counts[block] += 1

    def share_all(self, blocks: list[int], into: list[int] | None = None) -> None:
        """:meth:`share` each of ``blocks`` (distinct ids), all or nothing; ``into`` (an owner's
        block table) is extended with them in the same statement."""
        for block in blocks:
            if block not in self._evictable:
                self._check(block)
        if len(set(blocks)) != len(blocks):
            raise CacheError(f"share_all got repeated blocks {blocks}")
        revived = [b for b in blocks if b in self._evictable]
        into = [] if into is None else into
        # Commit.
        into[len(into):], _ = blocks, (np.add.at(self._ref_counts, blocks, 1), list(map(self._evictable.pop, revived)))

    def retain(self, block: int) -> None:
        """Keep ``block`` (in use) when its last reference goes, until it is evicted."""
        self._check(block)
        self._retained.add(block)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free (or evictable)."""
        counts = Counter(blocks)
        for block, count in counts.items():
            self._check(block)
            if count > self._ref_counts[block]:
                raise CacheError(f"block {block} freed {count} times but has {self._ref_counts[block]} references")
        released = [b for b, count in counts.items() if count == self._ref_counts[b]]
        kept = [b for b in released if b in self._retained]
        unkept = [b for b in released if b not in self._retained]
        ref_counts, free_list, evictable = self._ref_counts, self._free, self._evictable
        # Commit.
        _ = np.subtract.at(ref_counts, blocks, 1), free_list.extend(unkept), evictable.update(dict.fromkeys(kept))

    def _check(self, block: int) -> None:
        if not 1 <= block <= self.num_blocks:
            raise CacheError(f"block id {block} is not in 1..{self.num_blocks}")
        if self._ref_counts[block] == 0:
            raise CacheError(f"block {block} is already free")

    # ------------------------------------------------------------------------ invariants

    def check(self) -> list[str]:
        """Violations of the allocator's invariants (empty when it is consistent): every block is
        exactly one of in use (count > 0), free, or evictable (and then retained); no count is
        negative; the dummy block is never counted."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("the free list holds a block twice")
        evictable = set(self._evictable)
        for block in range(1, self.num_blocks + 1):
            count = int(self._ref_counts[block])
            states = (count > 0) + (block in free) + (block in evictable)
            if count < 0:
                problems.append(f"block {block} has reference count {count}")
            elif states != 1:
                problems.append(f"block {block}: count {count}, free {block in free}, evictable {block in evictable}")
        if not evictable <= self._retained:
            problems.append(f"evictable blocks {sorted(evictable - self._retained)} are not retained")
        if self._ref_counts[DUMMY_BLOCK] != 0 or DUMMY_BLOCK in free or DUMMY_BLOCK in evictable:
            problems.append("the dummy block is handed out")
        return problems

    def reset(self, retained: set[int]) -> None:
        """Drop every reference: the blocks in ``retained`` become evictable (kept for the prefix
        cache), all others free. For an engine with no live sequence, after an interrupted step."""
        retained = {b for b in retained if 1 <= b <= self.num_blocks}
        free = [b for b in range(self.num_blocks, 0, -1) if b not in retained]
        order = [b for b in self._evictable if b in retained]
        order += sorted(retained - set(order))
        # Commit.
        self._ref_counts[:], self._free, self._retained, self._evictable = 0, free, retained, OrderedDict.fromkeys(order)

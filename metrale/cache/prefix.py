"""Prefix cache: full KV blocks shared between sequences whose tokens agree up to that block.

Every full block of a sequence is named by a hash chain: the digest of block ``i`` covers the
parent digest (block ``i - 1``, or a root that encodes the sequence's adapter) and the block's
token ids, so equal digests mean equal token prefixes. :meth:`PrefixCache.publish` registers a
sequence's computed full blocks; :meth:`PrefixCache.lookup` walks a new prompt's chain and takes a
reference on every registered block it matches, stopping at the first miss.

Registered blocks are *retained* by the :class:`~metrale.cache.blocks.BlockAllocator`: when no
sequence references them any more they stay, evictable in least-recently-released order, and the
allocator evicts them (dropping their digest here) only when it runs out of free blocks.

A lookup takes references, so it is not idempotent: the engine looks up once per admission and,
when the admitted chunk has to wait, keeps the blocks and replays that first result rather than
looking up again.

**Models with recurrent state.** Cached blocks alone cannot resume such a model: the recurrent
state at the prefix's end is needed too. A registered block may carry a state snapshot (a row of
:class:`~metrale.cache.store.StateSnapshots`) taken when a sequence's computation stood exactly at
the block's end; :meth:`PrefixCache.lookup_with_state` resumes only at the deepest matched block
that has one, and never from a state it did not snapshot.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from metrale.cache.blocks import BlockAllocator


class PrefixCache:
    """Digest -> block map over a :class:`BlockAllocator` (see the module docstring)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, snapshots: Any = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.snapshots = snapshots
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._snapshot_of: dict[bytes, int] = {}
        self._digest_of_snapshot: dict[int, bytes] = {}
        allocator.on_evict = self._evicted
        if snapshots is not None:
            snapshots.on_drop = self._snapshot_dropped
        #: Blocks asked for and blocks found by :meth:`lookup`, over the cache's lifetime.
        self.queried_blocks = 0
        self.hit_blocks = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def _evicted(self, blocks: list[int]) -> None:
        blocks = [b for b in blocks if b in self._digest_of]
        digests = [self._digest_of[b] for b in blocks]
        snapshotted = [d for d in digests if d in self._snapshot_of]
        rows = [self._snapshot_of[d] for d in snapshotted]
        digest_of, block_of, snapshot_of, digest_of_snapshot = (
            self._digest_of, self._block_of, self._snapshot_of, self._digest_of_snapshot
        )
        # Commit: the maps forget the blocks in one line (a line is what an interrupt can land
        # between; the pops are built-in calls); the snapshot rows go back last (an interrupt
        # there leaves them taken and unclaimed, and the oldest taken rows are recycled first).
        _ = [*map(digest_of.pop, blocks), *map(block_of.pop, digests), *map(snapshot_of.pop, snapshotted), *map(digest_of_snapshot.pop, rows)]  # noqa: E501 (one line: the commit)
        if rows:
            self.snapshots.release_rows(rows)

    def _snapshot_dropped(self, row: int) -> None:
        digest = self._digest_of_snapshot.get(row)
        # Commit.
        _ = self._digest_of_snapshot.pop(row, None), None if digest is None else self._snapshot_of.pop(digest, None)

    @staticmethod
    def root(salt: object = None) -> bytes:
        """The parent digest of a sequence's first block (``salt``: e.g. its adapter slot)."""
        return hashlib.blake2b(repr(("metrale-prefix", salt)).encode(), digest_size=16).digest()

    def chain(self, tokens: Sequence[int], count: int, digests: list[bytes], salt: object = None) -> list[bytes]:
        """Extend ``digests`` (the chain of ``tokens``' first blocks, possibly empty) to ``count``
        full blocks and return it."""
        size = self.block_size
        parent = digests[-1] if digests else self.root(salt)
        for index in range(len(digests), count):
            block_tokens = np.asarray(tokens[index * size : (index + 1) * size], dtype=np.int64)
            parent = hashlib.blake2b(parent + block_tokens.tobytes(), digest_size=16).digest()
            digests.append(parent)
        return digests

    def lookup(self, tokens: Sequence[int], digests: list[bytes], salt: object = None,
               into: list[int] | None = None) -> list[int]:
        """Registered blocks matching the longest block-aligned prefix of ``tokens[:-1]`` (the last
        token is always computed, so the call returns logits); takes a reference on each and
        appends them to ``into`` (the sequence's block table) in the same statement."""
        count = (len(tokens) - 1) // self.block_size
        self.chain(tokens, count, digests, salt)
        blocks: list[int] = []
        for digest in digests[:count]:
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        self._take(blocks, count, into)
        return blocks

    def lookup_with_state(self, tokens: Sequence[int], digests: list[bytes], salt: object = None,
                          into: list[int] | None = None) -> tuple[list[int], int | None]:
        """Like :meth:`lookup`, but only up to the deepest matched block that carries a state
        snapshot: (those blocks, the snapshot's row), or ``([], None)``."""
        count = (len(tokens) - 1) // self.block_size
        self.chain(tokens, count, digests, salt)
        depth, row = 0, None
        for index, digest in enumerate(digests[:count]):
            if digest not in self._block_of:
                break
            if digest in self._snapshot_of:
                depth, row = index + 1, self._snapshot_of[digest]
        blocks = [self._block_of[digest] for digest in digests[:depth]]
        self._take(blocks, count, into)
        return blocks, row

    def _take(self, blocks: list[int], queried: int, into: list[int] | None) -> None:
        queried, hits = self.queried_blocks + queried, self.hit_blocks + len(blocks)
        # Commit: the references (recorded in ``into``) and the statistics in one statement.
        self.queried_blocks, self.hit_blocks, _ = queried, hits, self.allocator.share_all(blocks, into)

    def attach_snapshot(self, digest: bytes, row: int) -> bool:
        """Let the registered block ``digest`` carry snapshot ``row`` (its state at the block's
        end); False (and the row released) when the block is not registered or has one."""
        if digest not in self._block_of or digest in self._snapshot_of:
            self.snapshots.release(row)
            return False
        # Commit.
        self._snapshot_of[digest], self._digest_of_snapshot[row] = row, digest
        return True

    def publish(self, tokens: Sequence[int], block_table: Sequence[int], num_computed: int,
                digests: list[bytes], salt: object = None, first: int = 0) -> None:
        """Register the full blocks among positions ``[0, num_computed)`` of a sequence, from
        block ``first`` on (the earlier ones were published before).

        A digest already registered keeps its block (the sequence's own copy stays private).
        """
        count = min(num_computed // self.block_size, len(block_table))
        self.chain(tokens, count, digests, salt)
        for index in range(first, count):
            digest, block = digests[index], block_table[index]
            if digest in self._block_of or block in self._digest_of:
                continue
            # Commit (per block: each registered block is retained in the same statement).
            self._block_of[digest], self._digest_of[block], _ = block, digest, self.allocator.retain(block)

    def is_registered(self, block: int) -> bool:
        return block in self._digest_of

    def registered_blocks(self) -> set[int]:
        return set(self._digest_of)

    def snapshot_rows(self) -> list[int]:
        """The snapshot rows blocks carry."""
        return list(self._digest_of_snapshot)

    def check(self) -> list[str]:
        """Violations of the invariants: the digest and block maps mirror each other, as do the
        snapshot maps, and every snapshot belongs to a registered block."""
        problems = []
        if {b: d for d, b in self._block_of.items()} != self._digest_of:
            problems.append("the digest -> block and block -> digest maps disagree")
        if {r: d for d, r in self._snapshot_of.items()} != self._digest_of_snapshot:
            problems.append("the digest -> snapshot and snapshot -> digest maps disagree")
        if not set(self._snapshot_of) <= set(self._block_of):
            problems.append("a snapshot belongs to an unregistered block")
        return problems

    def repair(self) -> None:
        """Keep only the entries on which both directions of each map agree."""
        blocks = {d: b for d, b in self._block_of.items() if self._digest_of.get(b) == d}
        snapshots = {d: r for d, r in self._snapshot_of.items() if d in blocks and self._digest_of_snapshot.get(r) == d}
        self._block_of, self._digest_of = blocks, {b: d for d, b in blocks.items()}
        self._snapshot_of, self._digest_of_snapshot = snapshots, {r: d for d, r in snapshots.items()}

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

    def _evicted(self, block: int) -> None:
        digest = self._digest_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
            row = self._snapshot_of.pop(digest, None)
            if row is not None:
                del self._digest_of_snapshot[row]
                self.snapshots.release(row)

    def _snapshot_dropped(self, row: int) -> None:
        digest = self._digest_of_snapshot.pop(row, None)
        if digest is not None:
            del self._snapshot_of[digest]

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

    def lookup(self, tokens: Sequence[int], digests: list[bytes], salt: object = None) -> list[int]:
        """Registered blocks matching the longest block-aligned prefix of ``tokens[:-1]`` (the last
        token is always computed, so the call returns logits); takes a reference on each."""
        count = (len(tokens) - 1) // self.block_size
        self.chain(tokens, count, digests, salt)
        blocks: list[int] = []
        for digest in digests[:count]:
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self.allocator.share(block)
        self.queried_blocks += count
        self.hit_blocks += len(blocks)
        return blocks

    def lookup_with_state(self, tokens: Sequence[int], digests: list[bytes], salt: object = None) -> tuple[list[int], int | None]:
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
        for block in blocks:
            self.allocator.share(block)
        self.queried_blocks += count
        self.hit_blocks += len(blocks)
        return blocks, row

    def attach_snapshot(self, digest: bytes, row: int) -> bool:
        """Let the registered block ``digest`` carry snapshot ``row`` (its state at the block's
        end); False (and the row released) when the block is not registered or has one."""
        if digest not in self._block_of or digest in self._snapshot_of:
            self.snapshots.release(row)
            return False
        self._snapshot_of[digest] = row
        self._digest_of_snapshot[row] = digest
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
            self._block_of[digest] = block
            self._digest_of[block] = digest
            self.allocator.retain(block)

    def is_registered(self, block: int) -> bool:
        return block in self._digest_of

"""PrefixCache and the allocator's retained blocks."""

from __future__ import annotations

import pytest

from metrale.cache.blocks import BlockAllocator
from metrale.cache.prefix import PrefixCache
from metrale.errors import CacheError


def published(cache: PrefixCache, tokens: list[int], salt=None) -> list[int]:
    """Allocate blocks for ``tokens``, publish them as computed, return the table."""
    count = -(-len(tokens) // cache.block_size)
    table = cache.allocator.allocate(count)
    cache.publish(tokens, table, len(tokens), [], salt)
    return table


def test_lookup_finds_the_longest_published_chain_and_takes_references():
    allocator = BlockAllocator(10)
    cache = PrefixCache(allocator, block_size=4)
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    table = published(cache, tokens)
    assert len(cache) == 3  # the partial last block is not registered
    hit = cache.lookup(tokens[:12] + [7, 7, 7], [])
    assert hit == table[:3] and [allocator.ref_count(b) for b in hit] == [2, 2, 2]
    # A different second block ends the chain there, even though the third block's tokens agree.
    other = tokens[:4] + [0, 0, 0, 0] + tokens[8:12] + [1]
    assert cache.lookup(other, []) == table[:1]
    # The last token is always left to compute: 12 tokens match at most 2 blocks.
    assert cache.lookup(tokens[:12], []) == table[:2]
    assert (cache.queried_blocks, cache.hit_blocks) == (3 + 3 + 2, 3 + 1 + 2)


def test_salt_separates_chains():
    cache = PrefixCache(BlockAllocator(6), block_size=2)
    published(cache, [1, 2, 3, 4, 5], salt=None)
    assert cache.lookup([1, 2, 3, 4, 5], [], salt=1) == []
    assert len(cache.lookup([1, 2, 3, 4, 5], [], salt=None)) == 2


def test_released_blocks_stay_until_evicted_least_recent_first():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator, block_size=2)
    first = published(cache, [1, 2, 3, 4])
    second = published(cache, [9, 9, 8, 8])
    allocator.free(first)
    allocator.free(second)
    assert allocator.num_free == 4 and allocator.num_evictable == 4 and len(cache) == 4
    # A lookup takes a released block back without evicting anything.
    assert cache.lookup([9, 9, 8, 8, 0], []) == second
    assert allocator.num_evictable == 2
    # Allocating past the free list evicts the least recently released blocks: ``first``'s.
    fresh = allocator.allocate(2)
    assert sorted(fresh) == sorted(first) and len(cache) == 2
    assert cache.lookup([1, 2, 3, 4, 5], []) == []
    with pytest.raises(CacheError):
        allocator.allocate(1)


def test_a_duplicate_digest_keeps_the_first_block():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator, block_size=2)
    a = published(cache, [5, 6])
    b = published(cache, [5, 6])
    assert cache.is_registered(a[0]) and not cache.is_registered(b[0])
    allocator.free(b)
    assert allocator.num_evictable == 0  # b was never retained: it went straight back


def test_freeing_a_free_or_evictable_block_raises():
    allocator = BlockAllocator(2)
    cache = PrefixCache(allocator, block_size=1)
    table = published(cache, [3])
    allocator.free(table)
    with pytest.raises(CacheError, match="already free"):
        allocator.free(table)
